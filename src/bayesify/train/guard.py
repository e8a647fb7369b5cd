"""The step guard: one optimiser step either leaves every tensor usable or is undone.

A training step changes two kinds of state: the trainable tensors (by
``optimizer.step()``) and buffers (BatchNorm running statistics, per-member
statistics, …, updated *during the forward* of modules in training mode). A
single batch can poison either: a NaN/inf loss, an overflowing update, or a finite
but huge input (1e20) whose batch variance overflows to ``inf`` in a running
statistic while the loss stays finite. The guard:

1. :meth:`StepGuard.begin` — before the forward of an accumulation group: copy the
   buffers the forward can change (those of modules in training mode, unless a
   module declares ``bayesify_guard_buffers = False`` because only the family's
   post-step hook writes them, e.g. SWAG's moments);
   and, every :data:`ANCHOR_EVERY` steps, the anchor (below);
2. :meth:`StepGuard.before_update` — copy the trainable tensors before ``optimizer.step()``
   where the anchor cannot put them back (a recovery restores the anchor anyway);
3. :meth:`StepGuard.check` — names of guarded tensors that are non-finite or absurd
   (:func:`unusable`: beyond ``finfo.max / 2**20`` for fp32/fp64/bf16, where any
   further arithmetic overflows);
4. :meth:`StepGuard.rollback` — put everything back, so the model in memory is the
   last usable one when :class:`~bayesify.errors.NonFiniteLossError` is raised.

A step that fails is *recovered* before anything is raised (:func:`recover`): a
divergence builds over a few steps (an overflowing factor grows ×10–×1000 per step
before the loss turns NaN), so the guard keeps an *anchor* — the trainable tensors and
every buffer of the last sane state, refreshed every :data:`ANCHOR_EVERY` optimiser
steps while the loss stays within :data:`BLOW_UP` of the loss at the first anchor —
and a failed step (non-finite loss or gradient, a loss :data:`BLOW_UP` times the
reference, a step that left unusable values) puts the anchor back, clears the
optimiser state (momenta carry the divergence), halves the learning rate of every
optimiser group (the family's posterior groups and, with ``base_lr > 0``, the base),
logs a warning naming the family, the step and the new rates, and goes on with the
next batch. :class:`~bayesify.errors.NonFiniteLossError` is raised only after
:data:`MAX_RECOVERIES` recoveries, naming what was tried. Under DDP every input to
the decision is the same on every rank (the all-reduced loss and gradients; the
"unusable after the step" flag is summed over the ranks), so all ranks recover
together.

Checkpoint and posterior writers refuse unusable tensors in *every* section
(parameters, buffers, optimiser state), whatever the guard copied.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from bayesify.core.checks import unusable, unusable_mask
from bayesify.errors import NonFiniteLossError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

__all__ = ["MAX_RECOVERIES", "StepGuard", "recover", "step_guard", "unusable", "unusable_names"]

logger = logging.getLogger(__name__)

#: recoveries (roll back + halve the learning rate) before NonFiniteLossError
MAX_RECOVERIES = 6
#: optimiser steps between refreshes of the anchor (the state a recovery goes back to)
ANCHOR_EVERY = 20
#: a loss this many times the reference (the first anchor's, at least 1) is a divergence
BLOW_UP = 1e3

def unusable_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the unusable tensors of ``(name, tensor)`` pairs."""
    pairs = [(name, t) for name, t in named if isinstance(t, torch.Tensor)]
    flags = unusable_mask([t for _, t in pairs])
    return [name for (name, _), bad in zip(pairs, flags) if bad]


def guarded_buffers(bnn: BayesianModel) -> list[tuple[str, torch.Tensor]]:
    """Buffers a forward in the current modes can change: those of modules in training
    mode that do not opt out with ``bayesify_guard_buffers = False``."""
    out = []
    for prefix, module in bnn.named_modules():
        if not module.training or not getattr(module, "bayesify_guard_buffers", True):
            continue
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None:
                out.append((f"{prefix}.{name}" if prefix else name, buffer))
    return out


class StepGuard:
    """Copies of what one step may change, and the check that decides whether to keep it."""

    def __init__(self, bnn: BayesianModel) -> None:
        self.bnn = bnn
        self.buffers: list[tuple[str, torch.Tensor]] = []
        self.buffer_copies: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []
        self.param_copies: list[torch.Tensor] = []
        self.params_copied = False
        # the anchor of recoveries: trainable tensors and every buffer of the last sane state
        self.anchor_params: list[torch.Tensor] = []
        self.anchor_param_copies: list[torch.Tensor] = []
        self.anchor_buffer_copies: list[torch.Tensor] = []
        self.anchor_step: int | None = None
        self.reference: float | None = None
        self.healthy = True
        self.recoveries: list[str] = []

    def begin(self) -> None:
        """Copy the guarded buffers (before the forward of an accumulation group)."""
        self.buffers = guarded_buffers(self.bnn)
        self.buffer_copies = _copy_into(self.buffer_copies, [b for _, b in self.buffers])

    def before_update(self, params: list[torch.Tensor]) -> None:
        """Copy the trainable tensors (before ``optimizer.step()``) — unless the anchor holds
        these very tensors: a recovery puts the anchor back over whatever this copy would
        restore, so the copy (one pass over every trainable tensor per step) is only needed
        where the anchor cannot be restored and the error must leave the pre-step values."""
        self.params = list(params)
        self.params_copied = not self.anchor_restorable(self.params)
        if self.params_copied:
            self.param_copies = _copy_into(self.param_copies, self.params)

    def anchor_restorable(self, params: list[torch.Tensor]) -> bool:
        """Whether :meth:`rollback_to_anchor` can put these tensors (and every buffer) back."""
        return (self.anchor_step is not None
                and [id(p) for p in params] == [id(p) for p in self.anchor_params]
                and sum(1 for _ in self.bnn.buffers()) == len(self.anchor_buffer_copies))

    def check(self, params: list[torch.Tensor], names: dict[int, str] | None = None) -> list[str]:
        """Unusable trainable tensors (by name when ``names`` maps ``id → name``) and buffers."""
        labels = ([(names or {}).get(id(p), f"trainable tensor #{i}") for i, p in enumerate(params)]
                  + [f"buffer {n}" for n, _ in self.buffers])
        flags = unusable_mask(list(params) + [b for _, b in self.buffers])
        return [label for label, bad in zip(labels, flags) if bad]

    def blown_up(self, loss: float) -> bool:
        """Whether a finite ``loss`` is a divergence (``BLOW_UP`` × the reference)."""
        return self.reference is not None and loss > BLOW_UP * max(self.reference, 1.0)

    def keep_anchor(self, params: list[torch.Tensor], step: int) -> None:
        """Before the forward of optimiser step ``step``: copy the trainable tensors and every
        buffer when the anchor is ``ANCHOR_EVERY`` steps old and the last step succeeded."""
        if self.anchor_step is not None and (step - self.anchor_step < ANCHOR_EVERY
                                             or not self.healthy):
            return
        self.anchor_params = list(params)
        self.anchor_param_copies = _copy_into(self.anchor_param_copies, self.anchor_params)
        self.anchor_buffer_copies = _copy_into(self.anchor_buffer_copies, list(self.bnn.buffers()))
        self.anchor_step = step

    def succeeded(self, loss: float) -> None:
        """A step was kept: its loss becomes the reference of :meth:`blown_up` (the first)."""
        self.healthy = True
        if self.reference is None:
            self.reference = loss

    def rollback_to_anchor(self, params: list[torch.Tensor]) -> bool:
        """Put the anchor back (False when there is none for these tensors)."""
        if not self.anchor_restorable(params):
            return False
        buffers = list(self.bnn.buffers())
        with torch.no_grad():
            for p, copy in zip(self.anchor_params, self.anchor_param_copies):
                p.copy_(copy)
            for b, copy in zip(buffers, self.anchor_buffer_copies):
                b.copy_(copy)
        return True

    def rollback_buffers(self) -> None:
        with torch.no_grad():
            for (_, buffer), copy in zip(self.buffers, self.buffer_copies):
                buffer.copy_(copy)

    def rollback(self) -> None:
        """Put the trainable tensors (where :meth:`before_update` copied them; else the anchor
        does) and the buffers back as they were."""
        if self.params_copied:
            with torch.no_grad():
                for p, copy in zip(self.params, self.param_copies):
                    p.copy_(copy)
        self.rollback_buffers()


def _copy_into(copies: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if len(copies) != len(tensors) or any(
            c.shape != t.shape or c.dtype != t.dtype or c.device != t.device
            for c, t in zip(copies, tensors)):
        copies = [torch.empty_like(t) for t in tensors]
    if tensors:
        with torch.no_grad():
            torch._foreach_copy_(copies, [t.detach() for t in tensors])
    return copies


@contextlib.contextmanager
def buffers_restored_on_error(bnn: BayesianModel) -> Iterator[None]:
    """Every buffer of ``bnn`` is put back when the block raises (a curvature pass that
    fails half-way leaves no half-accumulated curvature behind)."""
    saved = [(b, b.detach().clone()) for b in bnn.buffers()]
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for buffer, copy in saved:
                buffer.copy_(copy)
        raise


def step_guard(state: Any) -> StepGuard:
    """The guard of a training state (created on first use, kept on the state)."""
    guard = getattr(state, "guard", None)
    if guard is None or guard.bnn is not state.bnn:
        guard = StepGuard(state.bnn)
        state.guard = guard
    return guard


def parameter_names(bnn: BayesianModel) -> dict[int, str]:
    """``id(tensor) → name`` of every parameter, for messages."""
    return {id(p): n for n, p in bnn.named_parameters()}


def unusable_step(state: Any, loss: float, params: list[torch.Tensor]) -> str | None:
    """After ``optimizer.step()``: what the step left unusable (``None`` when nothing), the
    same answer on every rank (the flag is summed over the ranks)."""
    from bayesify.train.distributed import all_reduce_sum  # same floor (train)

    guard = step_guard(state)
    bad = guard.check(params, parameter_names(state.bnn))
    ctx = getattr(state, "ctx", None)
    if ctx is not None and ctx.distributed:
        flag = torch.tensor([float(bool(bad))], device=ctx.device)
        if float(all_reduce_sum(flag, ctx)) > 0 and not bad:
            bad = ["(on another rank)"]
    if not bad:
        return None
    return (f"the optimiser step made the posterior non-finite (NaN/inf or overflowing values "
            f"in {bad[:5]}{'…' if len(bad) > 5 else ''}; loss was {loss:.4g})")


def _rates(groups: list[dict[str, Any]]) -> str:
    return ", ".join(f"{g.get('name', f'group {i}')} {g['lr']:.3g}" for i, g in enumerate(groups))


def recover(state: Any, where: str, what: str, *, after_update: bool = False) -> None:
    """A failed step (``what`` happened at ``where``): roll back, halve every optimiser
    group's learning rate and go on — or raise :class:`NonFiniteLossError` after
    :data:`MAX_RECOVERIES` recoveries (or when there is nothing sane to go back to)."""
    guard = step_guard(state)
    optimizer = state.optimizer
    optimizer.zero_grad(set_to_none=True)
    params = state.trainable()
    if after_update:
        guard.rollback()  # the step's own update and the forward's buffers
    else:
        guard.rollback_buffers()  # the forward may have poisoned BN statistics
    family = state.bnn.method_name
    before = _rates(optimizer.param_groups)
    guard.healthy = False
    restored = guard.rollback_to_anchor(params)  # also when giving up: the last sane state
    if len(guard.recoveries) >= MAX_RECOVERIES or not restored:
        tried = ("; ".join(guard.recoveries) if guard.recoveries
                 else "no recovery (no earlier sane state to go back to)")
        raise NonFiniteLossError(
            f"{what} at {where}, after {len(guard.recoveries)} recoveries of method "
            f"{family!r} (each rolled back to the last sane posterior, cleared the optimiser "
            f"state and halved the learning rate): {tried}. Learning rates now: {before}. The "
            "posterior and buffers in memory are the last finite ones; check the inputs for "
            "NaN/inf or absurd values, set clip_grad_norm, or start from a much lower lr")
    optimizer.state.clear()  # momenta carry the divergence
    state.base_lrs = [lr * 0.5 for lr in state.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= 0.5
    after = _rates(optimizer.param_groups)
    guard.recoveries.append(f"{where}: {what.split(' (')[0]}; lr {before} → {after}")
    if state.ctx.is_main:
        logger.warning(
            "%s: %s at %s; rolled back to the posterior of optimiser step %d, cleared the "
            "optimiser state and halved the learning rate: %s → %s (recovery %d of at most %d)",
            family, what, where, guard.anchor_step, before, after, len(guard.recoveries),
            MAX_RECOVERIES)
