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
2. :meth:`StepGuard.before_update` — copy the trainable tensors before ``optimizer.step()``;
3. :meth:`StepGuard.check` — names of guarded tensors that are non-finite or absurd
   (:func:`unusable`: beyond ``finfo.max / 2**20`` for fp32/fp64/bf16, where any
   further arithmetic overflows);
4. :meth:`StepGuard.rollback` — put everything back, so the model in memory is the
   last usable one when :class:`~bayesify.errors.NonFiniteLossError` is raised.

Checkpoint and posterior writers refuse unusable tensors in *every* section
(parameters, buffers, optimiser state), whatever the guard copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from bayesify.core.checks import unusable
from bayesify.errors import NonFiniteLossError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

__all__ = ["StepGuard", "step_guard", "unusable", "unusable_names"]

def unusable_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the unusable tensors of ``(name, tensor)`` pairs."""
    return [name for name, t in named if isinstance(t, torch.Tensor) and unusable(t)]


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

    def begin(self) -> None:
        """Copy the guarded buffers (before the forward of an accumulation group)."""
        self.buffers = guarded_buffers(self.bnn)
        self.buffer_copies = _copy_into(self.buffer_copies, [b for _, b in self.buffers])

    def before_update(self, params: list[torch.Tensor]) -> None:
        """Copy the trainable tensors (before ``optimizer.step()``)."""
        self.params = list(params)
        self.param_copies = _copy_into(self.param_copies, self.params)

    def check(self, params: list[torch.Tensor], names: dict[int, str] | None = None) -> list[str]:
        """Unusable trainable tensors (by name when ``names`` maps ``id → name``) and buffers."""
        bad = [(names or {}).get(id(p), f"trainable tensor #{i}")
               for i, p in enumerate(params) if unusable(p)]
        return bad + [f"buffer {n}" for n, b in self.buffers if unusable(b)]

    def rollback_buffers(self) -> None:
        with torch.no_grad():
            for (_, buffer), copy in zip(self.buffers, self.buffer_copies):
                buffer.copy_(copy)

    def rollback(self) -> None:
        """Put the trainable tensors and the buffers back as they were."""
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


def refuse_unusable_step(state: Any, where: str, loss: float, params: list[torch.Tensor]) -> None:
    """After ``optimizer.step()``: roll back and raise when anything guarded is unusable."""
    guard = step_guard(state)
    bad = guard.check(params, parameter_names(state.bnn))
    if bad:
        guard.rollback()
        raise NonFiniteLossError(
            f"the optimiser step at {where} made the posterior non-finite (NaN/inf or "
            f"overflowing values in {bad[:5]}{'…' if len(bad) > 5 else ''}; loss was "
            f"{loss:.4g}); the trainable tensors and buffers before that step were restored. "
            "Lower the learning rate, set clip_grad_norm, or check the inputs for absurd values"
        )
