"""The gradient steps of the one training loop: ELBO and SGD-snapshot.

``loss = mean NLL over the tiled batch + β(t) · w_i · KL / N_train`` (``w_i`` the
family's minibatch KL weighting, 1 by default). Snapshot families (SWAG, snapshot
ensembles) take the same step with ``KL = 0`` and collect the iterates in
``method.after_step``; the curvature pass (Laplace) lives in
:mod:`bayesify.train.curvature`.

A step never leaves a non-finite posterior behind (:mod:`bayesify.train.guard`):
the buffers a forward can change (BatchNorm statistics) are copied before it and
the trainable tensors before ``optimizer.step()``; both are restored when the loss
is non-finite or the step left NaN/inf or overflowing values anywhere.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from bayesify.core.batch import Batch
from bayesify.errors import BayesifyError, NonFiniteLossError
from bayesify.train.distributed import DistContext, all_reduce_mean
from bayesify.train.guard import refuse_unusable_step, step_guard
from bayesify.train.intent import trainable_base_parameters
from bayesify.train.loss import nll_and_kl
from bayesify.train.schedules import beta_schedule, lr_factor

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


class TrainForward(nn.Module):
    """``(args, kwargs, y) → (mean NLL, KL)`` of one tiled batch: the module DDP wraps.

    Routing the family's ``training_forward`` through this module's ``forward``
    is what lets ``DistributedDataParallel`` hook the backward pass (DDP only
    all-reduces gradients of a forward that went through the DDP wrapper).
    Inputs travel as a tuple and a dict (which DDP and ``torch.compile`` handle);
    noise is drawn from ``generator`` (this rank's stream), in fp32.
    """

    def __init__(self, bnn: BayesianModel, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.bnn = bnn
        self.generator = generator

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs: Any = Batch(tuple(args), dict(kwargs), None)
        if not kwargs and len(args) == 1:
            inputs = args[0]  # a plain tensor keeps the tensor path of every family
        return nll_and_kl(self.bnn, inputs, y, self.generator)


@dataclass
class TrainState:
    bnn: BayesianModel
    optimizer: torch.optim.Optimizer
    base_lrs: list[float]
    schedules: list[Any]
    epochs: int
    steps_per_epoch: int
    n_train: int
    kl_anneal_epochs: float
    beta_max: float
    epoch: int = 0
    #: batches done in the current epoch (micro-batches with accumulation)
    step: int = 0
    #: optimiser steps since the start of training
    global_step: int = 0
    #: the module called for the loss terms: TrainForward, its DDP wrapper, compiled
    forward: nn.Module | None = None
    ddp: nn.Module | None = None
    ctx: DistContext = field(default_factory=DistContext)
    amp: bool = False
    channels_last: bool = False
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    noise_generator: torch.Generator | None = None
    #: ``[loss, nll, kl]`` of the micro-batches of the open accumulation group
    pending: list[torch.Tensor] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    #: running sums of the current epoch (restored on mid-epoch resume)
    totals: dict[str, float] = field(default_factory=dict)
    #: copies of the trainable tensors taken before the latest optimiser step
    backup: list[torch.Tensor] = field(default_factory=list)
    #: classes of the model's output (set from the first batch; labels are checked)
    num_classes: int | None = None

    @property
    def progress(self) -> float:
        """Epochs done, fractional: the argument of every schedule."""
        group_start = (self.step // self.grad_accum_steps) * self.grad_accum_steps
        return self.epoch + group_start / max(self.steps_per_epoch, 1)

    def trainable(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]


def build_optimizer(
    bnn: BayesianModel,
    *,
    lr: float,
    base_lr: float,
    optimizer: str,
    momentum: float,
    weight_decay: float,
    base_weight_decay: float,
) -> torch.optim.Optimizer:
    """Posterior group(s) from the family (large LR, no weight decay) + base group if ``base_lr > 0``."""
    groups = bnn.method.param_groups(bnn, lr=lr, weight_decay=weight_decay)
    if base_lr > 0:  # only what the user left trainable (bayesify.train.intent)
        groups.append({"params": trainable_base_parameters(bnn), "lr": base_lr,
                       "weight_decay": base_weight_decay, "name": "base"})
    else:
        bnn.set_base_trainable(False)
    if not any(g["params"] for g in groups):
        raise BayesifyError(
            f"method {bnn.method_name!r} has no trainable parameters; use base_lr > 0 "
            "or a gradient-trained family"
        )
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
        state.forward = TrainForward(state.bnn, state.noise_generator)
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
        state.bnn.method.before_step(state.bnn, state)
        step_guard(state).begin()  # buffers the forward may change (BatchNorm statistics)
    sync = (state.ddp.no_sync() if state.ddp is not None and not closes  # type: ignore[operator]
            else contextlib.nullcontext())
    autocast = (torch.autocast(device_type=y.device.type, dtype=torch.bfloat16) if state.amp
                else contextlib.nullcontext())
    with sync:
        with autocast:
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
    """Family hook ``method.kl_weight(i, M)``: minibatch KL weighting (1 when absent).

    ``i``/``M`` count optimiser steps of the epoch, so the weights sum to M over
    an epoch whatever the accumulation.
    """
    hook = getattr(state.bnn.method, "kl_weight", None)
    if hook is None:
        return 1.0
    accum = state.grad_accum_steps
    total = -(-state.steps_per_epoch // accum) if state.steps_per_epoch > 0 else 0
    return float(hook(group_start // accum, total))


def _optimizer_step(state: TrainState, beta: float, batch_index: int) -> dict[str, float]:
    means = all_reduce_mean(torch.stack(state.pending).mean(0), state.ctx)
    state.pending.clear()
    loss, nll, kl = means.tolist()
    where = (f"epoch {state.epoch}, step {batch_index} (optimiser step {state.global_step}; "
             f"method {state.bnn.method_name!r})")
    if not all(map(math.isfinite, (loss, nll, kl))):
        state.optimizer.zero_grad(set_to_none=True)
        step_guard(state).rollback_buffers()  # the forward may have poisoned BN statistics
        raise NonFiniteLossError(
            f"non-finite loss at {where}: nll={nll:.4g}, kl={kl:.4g}, beta={beta:.4g}, "
            f"lr={state.optimizer.param_groups[0]['lr']:.4g}. The posterior and buffers in "
            "memory are the last finite ones (no step was taken); lower the learning rate, "
            "raise clip_grad_norm or check the inputs for NaN/inf"
        )
    params = state.trainable()
    if state.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, state.clip_grad_norm)
    step_guard(state).before_update(params)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    refuse_unusable_step(state, where, loss, params)  # parameters and buffers, rolled back
    state.global_step += 1
    state.bnn.method.after_step(state.bnn, state)
    return {"loss": loss, "nll": nll, "kl": kl, "beta": beta}


def flush_group(state: TrainState, beta: float) -> dict[str, float] | None:
    """Step on a partial accumulation group left at the end of an unsized epoch."""
    if not state.pending:
        return None
    if state.ddp is not None and state.ctx.distributed:  # the last backward ran under no_sync
        for p in state.bnn.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= state.ctx.world_size
    return _optimizer_step(state, beta, state.step - 1)
