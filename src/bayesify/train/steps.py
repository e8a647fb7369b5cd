"""The gradient-step service of the fit context: optimiser, accumulation, DDP, AMP.

``loss = mean NLL over the tiled batch + β(t) · w_i · KL / N_train`` with the NLL and KL
from the family's ``Step.terms`` and ``w_i`` its ``Step.kl_weight`` (1 by default);
``Step.before_update`` / ``Step.after_update`` run around every optimiser step (SWAG
collects its iterates there). A step calls this through ``ctx.gradient_step(batch)``.

A step never leaves a non-finite posterior behind (:mod:`bayesify.train.guard`):
the buffers a forward can change (BatchNorm statistics) are copied before it and
the trainable tensors before ``optimizer.step()``; both are restored when the loss
is non-finite or the step left NaN/inf or overflowing values anywhere.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.batch import Batch
from bayesify.core.fitting import Step
from bayesify.errors import BayesifyError
from bayesify.train.distributed import all_reduce_mean
from bayesify.train.guard import recover, step_guard, unusable_step
from bayesify.train.intent import trainable_base_parameters
from bayesify.train.schedules import beta_schedule, lr_factor

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel
    from bayesify.train.context import TrainState


class TrainForward(nn.Module):
    """``(args, kwargs, y) → (mean NLL, KL)`` of one tiled batch: the module DDP wraps.

    Routing the step's ``terms`` through this module's ``forward`` is what lets
    ``DistributedDataParallel`` hook the backward pass (DDP only all-reduces
    gradients of a forward that went through the DDP wrapper). Inputs travel as a
    tuple and a dict (which DDP and ``torch.compile`` handle); noise is drawn from
    ``generator`` (this rank's stream), in fp32.
    """

    def __init__(self, bnn: BayesianModel, generator: torch.Generator | None = None,
                 step: Step | None = None) -> None:
        super().__init__()
        self.bnn = bnn
        self.generator = generator
        self.step = step if step is not None else bnn.method.step()

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs: Any = Batch(tuple(args), dict(kwargs), None)
        if not kwargs and len(args) == 1:
            inputs = args[0]  # a plain tensor keeps the tensor path of every family
        return self.step.terms(self.bnn, inputs, y, self.generator)


class SeededCompiledForward:
    """A compiled :class:`TrainForward` whose noise comes from the global RNG, seeded on every
    call from the fit's noise generator.

    ``torch.compile`` cannot put a ``torch.Generator`` into a graph: a draw with
    ``generator=`` broke the graph at every wrapped layer (a ResNet-18 iBNN step: 40 graphs,
    39 breaks) and Dynamo then recompiled the per-layer frame for each layer until its
    recompile limit, so a compiled ResNet-50 step never got faster than eager (measured on
    an H100). The compiled module draws with the global RNG instead (one graph, no break);
    every call runs inside ``fork_rng`` seeded with a number drawn from the fit's generator,
    so the stream is still the fit's (per rank, reproducible, resumed with the generator's
    state) and the caller's global RNG is left as it was."""

    def __init__(self, compiled: Callable[..., Any], generator: torch.Generator | None,
                 device: torch.device) -> None:
        self.compiled, self.generator, self.device = compiled, generator, device

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.generator is None:
            return self.compiled(args, kwargs, y)
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator,
                                 device=self.generator.device))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return self.compiled(args, kwargs, y)


def optimiser_groups(bnn: BayesianModel, step: Step, *, lr: float, weight_decay: float,
                     base_lr: float, base_weight_decay: float) -> list[dict[str, Any]]:
    """The family's posterior group(s) at ``lr`` and, with ``base_lr > 0``, the base weights
    the user left trainable (``bayesify.train.intent``); with ``base_lr == 0`` the base is
    frozen. No trainable parameter at all is an error."""
    groups = step.param_groups(bnn, lr=lr, weight_decay=weight_decay)
    if base_lr > 0:
        groups.append({"params": trainable_base_parameters(bnn), "lr": base_lr,
                       "weight_decay": base_weight_decay, "name": "base"})
    else:
        bnn.set_base_trainable(False)
    if not any(g["params"] for g in groups):
        raise BayesifyError(
            f"method {bnn.method_name!r} has no trainable posterior parameters (e.g. dropout "
            "with train_weights=False, or a post-hoc family); nothing to optimise: call "
            "bayesify.tune(bnn, val_loader) directly, or use base_lr > 0")
    return groups


def build_optimizer(
    bnn: BayesianModel,
    *,
    lr: float,
    base_lr: float,
    optimizer: str,
    momentum: float,
    weight_decay: float,
    base_weight_decay: float,
    step: Step | None = None,
) -> torch.optim.Optimizer:
    """Posterior group(s) from the family's step (large LR, no weight decay) + base group
    if ``base_lr > 0``."""
    groups = optimiser_groups(bnn, step if step is not None else bnn.method.step(), lr=lr,
                              weight_decay=weight_decay, base_lr=base_lr,
                              base_weight_decay=base_weight_decay)
    if optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0)
    if optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise BayesifyError(f"unknown optimizer {optimizer!r}; use 'sgd', 'adam' or 'adamw'")


def _closes_group(state: TrainState) -> tuple[bool, int]:
    """Whether this micro-batch ends an accumulation group, and the group's size."""
    accum, step, total = state.grad_accum_steps, state.step, state.steps_per_epoch
    start = (step // accum) * accum
    size = accum if total <= 0 else min(accum, total - start)
    return (step + 1) % accum == 0 or (total > 0 and step + 1 >= total), max(size, 1)


def train_step(state: TrainState, batch: Batch | torch.Tensor,
               y: torch.Tensor | None = None) -> dict[str, float] | None:
    """One micro-batch; returns the (rank-averaged) loss terms when the optimiser stepped.

    With ``grad_accum_steps = A`` the gradients of A micro-batches are summed
    (each scaled by 1/A, so the step sees the mean loss) and DDP all-reduces
    only on the last one (``no_sync`` before). Non-finite loss → error naming
    the step, before the parameters change.
    """
    if not isinstance(batch, Batch):
        batch = Batch((batch,), {}, y)
    if state.forward is None:
        state.forward = TrainForward(state.bnn, state.noise_generator, state.family)
    y = batch.require_labels("fit")
    closes, size = _closes_group(state)
    # schedules are read at the start of the accumulation group: A micro-batches of
    # size B follow exactly the trajectory of one batch of size A·B
    group_start = (state.step // state.grad_accum_steps) * state.grad_accum_steps
    progress = state.progress
    beta = beta_schedule(progress, anneal_epochs=state.kl_anneal_epochs, beta_max=state.beta_max)
    for group, base, schedule in zip(state.optimizer.param_groups, state.base_lrs, state.schedules):
        group["lr"] = base * lr_factor(progress, schedule, epochs=state.epochs)
    if state.step % state.grad_accum_steps == 0:
        state.family.before_update(state)
        guard = step_guard(state)
        guard.begin()  # buffers the forward may change (BatchNorm statistics)
        guard.keep_anchor(state.trainable(), state.global_step)  # what a recovery goes back to
    sync = (state.ddp.no_sync() if state.ddp is not None and not closes  # type: ignore[operator]
            else contextlib.nullcontext())
    with sync:
        with state.autocast():
            nll, kl = state.forward(batch.args, batch.kwargs, y)
        loss = nll + beta * _kl_weight(state, group_start) * kl / state.n_train
        (loss / size).backward()
    state.pending.append(torch.stack([loss.detach(), nll.detach(), kl.detach()]).float())
    batch_index = state.step
    state.step += 1
    if not closes:
        return None
    return _optimizer_step(state, beta, batch_index)


def _kl_weight(state: TrainState, group_start: int) -> float:
    """The step's minibatch KL weighting ``Step.kl_weight(i, M)``.

    ``i``/``M`` count optimiser steps of the epoch, so the weights sum to M over
    an epoch whatever the accumulation.
    """
    accum = state.grad_accum_steps
    total = -(-state.steps_per_epoch // accum) if state.steps_per_epoch > 0 else 0
    return float(state.family.kl_weight(group_start // accum, total))


def guarded_update(state: Any, guard: Any, where: str, loss: float,
                   detail: Callable[[], str]) -> bool:
    """One guarded optimiser update of ``state`` (``optimizer``, ``trainable()``,
    ``clip_grad_norm``, ``global_step``): refused and recovered
    (:func:`bayesify.train.guard.recover`: rolled back, learning rate halved) on a
    non-finite or diverging ``loss`` (``detail()`` says what it was made of; built only
    then, off the hot path), a non-finite
    gradient or unusable values after the step; ``True`` when the update was made. The
    gradients are all-reduced already under DDP: every rank takes the same decision."""
    if not math.isfinite(loss) or guard.blown_up(loss):
        recover(state, where, f"{'non-finite' if not math.isfinite(loss) else 'diverging'} "
                f"loss ({loss:.4g}; {detail()})")
        return False
    params = state.trainable()
    grads = [p.grad for p in params if p.grad is not None]
    if grads and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())):
        recover(state, where, f"non-finite gradient (loss={loss:.4g})")
        return False
    if state.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, state.clip_grad_norm)
    guard.before_update(params)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    bad = unusable_step(state, loss, params)
    if bad is not None:
        recover(state, where, bad, after_update=True)
        return False
    guard.succeeded(loss)
    state.global_step += 1
    return True


def _optimizer_step(state: TrainState, beta: float, batch_index: int) -> dict[str, float] | None:
    """The optimiser step of an accumulation group; ``None`` when the step failed and was
    recovered (:func:`bayesify.train.guard.recover`: rolled back, learning rate halved)."""
    means = all_reduce_mean(torch.stack(state.pending).mean(0), state.ctx)
    state.pending.clear()
    loss, nll, kl = means.tolist()
    where = (f"epoch {state.epoch}, step {batch_index} (optimiser step {state.global_step}; "
             f"method {state.bnn.method_name!r})")

    def detail() -> str:
        rates = ", ".join(f"{g.get('name', i)} {g['lr']:.4g}"
                          for i, g in enumerate(state.optimizer.param_groups))
        return f"nll={nll:.4g}, kl={kl:.4g}, beta={beta:.4g}, lr: {rates}"

    finite = all(map(math.isfinite, (nll, kl)))
    if not guarded_update(state, step_guard(state), where, loss if finite else math.nan, detail):
        return None
    state.family.after_update(state)
    return {"loss": loss, "nll": nll, "kl": kl, "beta": beta}


def flush_group(state: TrainState, beta: float) -> dict[str, float] | None:
    """Step on a partial accumulation group left at the end of an unsized epoch."""
    if not state.pending:
        return None
    if state.ddp is not None and state.ctx.distributed:  # the last backward ran under no_sync
        for p in state.bnn.parameters():
            if p.grad is not None:
                p.grad.copy_(all_reduce_mean(p.grad, state.ctx))
    return _optimizer_step(state, beta, state.step - 1)
