"""``bayesify.fit``: loss = mean NLL over the tiled batch + β(t)·KL / N_train.

One loop for every gradient-trained family; post-hoc families (``method.fit``)
take over the data loop themselves. The loop keeps its state in a
:class:`TrainState` (no globals).

Data parallel (DESIGN.md §5): launched by ``torchrun`` the loop initialises the
process group (nccl on CUDA, gloo on CPU), shards every global batch over the
ranks (:mod:`bayesify.train.data`), calls the model through
``DistributedDataParallel`` (frozen base weights have ``requires_grad=False`` and
are ignored by DDP, so only trainable tensors are all-reduced), gives every rank
its own noise stream, averages logged terms over ranks and logs/checkpoints on
rank 0. Checkpoints (:mod:`bayesify.train.resume`) make a killed run resumable
to the same final posterior.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from bayesify.errors import BayesifyError, NonFiniteLossError
from bayesify.train.data import TrainData
from bayesify.train.distributed import (
    DistContext,
    all_reduce_mean,
    all_reduce_sum,
    broadcast_object,
    rank_seed,
    setup_distributed,
)
from bayesify.train.options import validate_fit_options
from bayesify.train.schedules import beta_schedule, lr_factor, parse_schedule

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


@dataclass
class FitResult:
    """What ``fit`` returns: one dict per epoch (loss, nll, kl, beta, lr, val_*)."""

    history: list[dict[str, Any]] = field(default_factory=list)
    last_checkpoint: str | None = None

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.history[i]

    def __len__(self) -> int:
        return len(self.history)

    @property
    def last(self) -> dict[str, Any]:
        return self.history[-1]


class TrainForward(nn.Module):
    """``(x, y) → (mean NLL, KL)`` of one tiled batch: the module DDP wraps.

    Routing the family's ``training_forward`` through this module's ``forward``
    is what lets ``DistributedDataParallel`` hook the backward pass (DDP only
    all-reduces gradients of a forward that went through the DDP wrapper).
    Noise is drawn from ``generator`` (this rank's stream), in fp32.
    """

    def __init__(self, bnn: BayesianModel, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.bnn = bnn
        self.generator = generator

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.bnn.context.use(None, generator=self.generator):
            logits, targets = self.bnn.training_forward(x, y)
        nll = F.cross_entropy(logits.float(), targets)
        with torch.autocast(device_type=x.device.type, enabled=False):
            kl = self.bnn.kl().float()  # KL stays in fp32 under AMP
        return nll, kl


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
    if base_lr > 0:
        bnn.set_base_trainable(True)
        groups.append({"params": bnn.base_parameters(), "lr": base_lr,
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


def _batches(loader: Iterable, device: torch.device, channels_last: bool = False):
    for batch in loader:
        x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        yield x, y


def _closes_group(state: TrainState) -> tuple[bool, int]:
    """Whether this micro-batch ends an accumulation group, and the group's size."""
    accum, step, total = state.grad_accum_steps, state.step, state.steps_per_epoch
    start = (step // accum) * accum
    size = accum if total <= 0 else min(accum, total - start)
    return (step + 1) % accum == 0 or (total > 0 and step + 1 >= total), max(size, 1)


def train_step(state: TrainState, x: torch.Tensor, y: torch.Tensor) -> dict[str, float] | None:
    """One micro-batch; returns the (rank-averaged) loss terms when the optimiser stepped.

    With ``grad_accum_steps = A`` the gradients of A micro-batches are summed
    (each scaled by 1/A, so the step sees the mean loss) and DDP all-reduces
    only on the last one (``no_sync`` before). Non-finite loss → error naming
    the step, before the parameters change.
    """
    if state.forward is None:
        state.forward = TrainForward(state.bnn, state.noise_generator)
    closes, size = _closes_group(state)
    # schedules are read at the start of the accumulation group: A micro-batches of
    # size B follow exactly the trajectory of one batch of size A·B
    group_start = (state.step // state.grad_accum_steps) * state.grad_accum_steps
    progress = state.epoch + group_start / max(state.steps_per_epoch, 1)
    beta = beta_schedule(progress, anneal_epochs=state.kl_anneal_epochs, beta_max=state.beta_max)
    for group, base, schedule in zip(state.optimizer.param_groups, state.base_lrs, state.schedules):
        group["lr"] = base * lr_factor(progress, schedule, epochs=state.epochs)
    sync = (state.ddp.no_sync() if state.ddp is not None and not closes  # type: ignore[operator]
            else contextlib.nullcontext())
    autocast = (torch.autocast(device_type=x.device.type, dtype=torch.bfloat16) if state.amp
                else contextlib.nullcontext())
    with sync:
        with autocast:
            nll, kl = state.forward(x, y)
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
    if not all(map(_finite, (loss, nll, kl))):
        state.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(
            f"non-finite loss at epoch {state.epoch}, step {batch_index} (optimiser step "
            f"{state.global_step}; nll={nll:.4g}, kl={kl:.4g}); lower the learning rate "
            "or check the inputs for NaN/inf. The last good checkpoint is kept."
        )
    if state.clip_grad_norm is not None:
        params = [p for g in state.optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, state.clip_grad_norm)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.global_step += 1
    return {"loss": loss, "nll": nll, "kl": kl, "beta": beta}


def _finite(v: float) -> bool:
    return math.isfinite(v)


def _flush_group(state: TrainState, beta: float) -> dict[str, float] | None:
    """Step on a partial accumulation group left at the end of an unsized epoch."""
    if not state.pending:
        return None
    if state.ddp is not None and state.ctx.distributed:  # the last backward ran under no_sync
        for p in state.bnn.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= state.ctx.world_size
    return _optimizer_step(state, beta, state.step - 1)


def fit(
    bnn: BayesianModel,
    train_loader: Iterable,
    *,
    epochs: int = 1,
    lr: float | None = None,
    base_lr: float = 0.0,
    kl_anneal_epochs: float = 0.0,
    beta: float = 1.0,
    lr_schedule: Any = "constant",
    base_lr_schedule: Any = "constant",
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    base_weight_decay: float = 0.0,
    n_train: int | None = None,
    val_loader: Iterable | None = None,
    device: str | torch.device | None = None,
    log_dir: str | Path | None = None,
    progress: bool = True,
    seed: int | None = None,
    amp: bool | None = None,
    channels_last: bool = False,
    compile: bool | dict[str, Any] = False,
    grad_accum_steps: int = 1,
    clip_grad_norm: float | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every_steps: int = 0,
    keep_checkpoints: int = 2,
    resume: str | Path | None = None,
    callbacks: Sequence[Any] = (),
    val_every: int = 1,
    val_samples_per_component: int | None = None,
    find_unused_parameters: bool = False,
    **method_kwargs: Any,
) -> FitResult:
    """Fine-tune the posterior of ``bnn`` on ``train_loader``.

    Loss per step: mean NLL over the tiled batch + β(t)·KL/N_train, β(t) linear
    0 → ``beta`` over ``kl_anneal_epochs`` (fixed when 0). Posterior group: SGD
    Nesterov at ``lr`` (default: the family's), no weight decay; base weights stay
    frozen unless ``base_lr > 0``. ``lr_schedule`` / ``base_lr_schedule``: see
    :func:`bayesify.train.schedules.lr_factor`. Post-hoc families delegate to
    ``method.fit``.

    Under ``torchrun`` the loader's ``batch_size`` is per rank (global batch =
    batch_size × world size) and the data order of epoch e is a function of
    ``(seed, e)``, as it is in a single process whenever ``seed``,
    ``checkpoint_dir`` or ``resume`` is given. ``amp`` (default: on for CUDA)
    runs the forward in bf16 autocast; KL and noise stay fp32. ``checkpoint_dir``:
    an atomic checkpoint after every epoch (and every ``checkpoint_every_steps``
    optimiser steps), the newest ``keep_checkpoints`` kept; ``resume``: a
    checkpoint file or directory to continue from. ``callbacks``: objects with
    optional ``on_step_end(state, terms)`` / ``on_epoch_end(state, record)``
    (a plain callable is ``on_epoch_end``), called after the checkpoint is written.
    """
    validate_fit_options(**locals())  # every option checked before anything changes
    from bayesify.train import resume as ckpt

    if epochs <= 0:
        raise BayesifyError(f"epochs must be positive, got {epochs}")
    if grad_accum_steps < 1:
        raise BayesifyError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    ctx = setup_distributed(device, bnn.device)
    if device is not None or ctx.device != bnn.device:
        bnn.to(ctx.device)
    n_train = n_train or _dataset_size(train_loader)
    if not bnn.method.gradient_trained:
        if val_loader is not None:  # post-hoc families may tune on it (Laplace τ)
            method_kwargs["val_loader"] = val_loader
        info = bnn.method.fit(bnn, train_loader, epochs=epochs, lr=lr, device=bnn.device,
                              progress=progress, **method_kwargs)
        return FitResult(history=[info or {}])
    if method_kwargs:
        raise BayesifyError(f"unknown fit option(s) {sorted(method_kwargs)}")
    lr = lr if lr is not None else bnn.method.default_lr()
    lr_schedule, base_lr_schedule = parse_schedule(lr_schedule), parse_schedule(base_lr_schedule)
    opt = build_optimizer(bnn, lr=lr, base_lr=base_lr, optimizer=optimizer, momentum=momentum,
                          weight_decay=weight_decay, base_weight_decay=base_weight_decay)
    schedules = [base_lr_schedule if g.get("name") == "base" else lr_schedule
                 for g in opt.param_groups]
    checkpointing = checkpoint_dir is not None or resume is not None
    payload = ckpt.read_for_resume(resume, ctx) if resume is not None else None
    if seed is None and payload is not None:
        seed = int(payload["meta"]["options"]["seed"])
    seeded = seed is not None or checkpointing or ctx.distributed
    if seed is None:
        seed = broadcast_object(int(torch.randint(0, 2**31 - 1, ()).item()), ctx)
    if ctx.distributed:  # families drawing from the global RNG get per-rank streams too
        torch.manual_seed(rank_seed(seed, ctx.rank) % (2**31))
    data = TrainData(train_loader, ctx=ctx, seed=seed, seeded=seeded)
    noise = torch.Generator(device=ctx.device)
    noise.manual_seed(rank_seed(seed, ctx.rank))
    if channels_last:
        bnn.model.to(memory_format=torch.channels_last)
    state = TrainState(
        bnn=bnn, optimizer=opt, base_lrs=[g["lr"] for g in opt.param_groups],
        schedules=schedules, epochs=epochs, steps_per_epoch=data.batches_per_epoch,
        n_train=n_train, kl_anneal_epochs=kl_anneal_epochs, beta_max=beta, ctx=ctx,
        amp=(ctx.device.type == "cuda") if amp is None else bool(amp),
        channels_last=channels_last, grad_accum_steps=grad_accum_steps,
        clip_grad_norm=clip_grad_norm, noise_generator=noise,
    )
    options = {
        "lr": lr, "base_lr": base_lr, "kl_anneal_epochs": kl_anneal_epochs, "beta": beta,
        "lr_schedule": lr_schedule, "base_lr_schedule": base_lr_schedule,
        "optimizer": optimizer, "momentum": momentum, "weight_decay": weight_decay,
        "base_weight_decay": base_weight_decay, "n_train": n_train, "seed": seed,
        "global_batch_size": data.global_batch_size, "grad_accum_steps": grad_accum_steps,
        "clip_grad_norm": clip_grad_norm,
    }
    options = json.loads(json.dumps(options))
    run = ckpt.Run(directory=Path(checkpoint_dir) if checkpoint_dir is not None else None,
                   keep=keep_checkpoints, every=checkpoint_every_steps, options=options,
                   identity=ckpt.identity(bnn) if checkpointing else {})
    if payload is not None:
        ckpt.restore(state, payload, run, path=payload["path"])
    state.forward = TrainForward(bnn, noise)
    if ctx.distributed:
        state.ddp = _wrap_ddp(state.forward, ctx, sync_buffers=bnn.bn_train,
                              find_unused_parameters=find_unused_parameters)
        state.forward = state.ddp
    if compile:
        state.forward = torch.compile(state.forward, **(compile if isinstance(compile, dict) else {}))
    result = FitResult(history=state.history)
    log_path = Path(log_dir) / "history.jsonl" if log_dir is not None and ctx.is_main else None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    hooks = [_as_callback(c) for c in callbacks]
    while state.epoch < epochs:
        record = _train_epoch(state, data, progress=progress and ctx.is_main, run=run, hooks=hooks)
        is_last = state.epoch + 1 == epochs
        if val_loader is not None and ((state.epoch + 1) % max(val_every, 1) == 0 or is_last):
            from bayesify.train.evaluate import evaluate_sharded

            metrics = evaluate_sharded(bnn, val_loader, ctx,
                                       samples_per_component=val_samples_per_component,
                                       amp=state.amp, channels_last=channels_last)
            record.update({f"val_{k}": v for k, v in metrics.items() if isinstance(v, float)})
        state.history.append(record)
        state.epoch, state.step, state.totals = state.epoch + 1, 0, {}
        if run.directory is not None:
            result.last_checkpoint = ckpt.save(state, run)
        if log_path is not None:
            with log_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
        for hook in hooks:
            hook.on_epoch_end(state, record)
    bnn.eval()
    return result


def _wrap_ddp(module: nn.Module, ctx: DistContext, *, sync_buffers: bool,
              find_unused_parameters: bool) -> nn.Module:
    """``DistributedDataParallel`` over the trainable tensors of ``module``.

    Tensors with ``requires_grad=False`` (the frozen base) are not registered with
    DDP's reducer, so they are never all-reduced. Buffers (BatchNorm statistics)
    are synchronised every forward only when BatchNorm trains (``bn_train``);
    frozen statistics are identical on every rank after DDP's initial broadcast.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    kwargs: dict[str, Any] = {"find_unused_parameters": find_unused_parameters}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        kwargs["forward_sync_buffers"] = sync_buffers
    else:
        kwargs["broadcast_buffers"] = sync_buffers
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, **kwargs)


class _Callback:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def on_step_end(self, state: TrainState, terms: dict[str, float]) -> None:
        fn = getattr(self.obj, "on_step_end", None)
        if fn is not None:
            fn(state, terms)

    def on_epoch_end(self, state: TrainState, record: dict[str, Any]) -> None:
        fn = getattr(self.obj, "on_epoch_end", None)
        if fn is None and callable(self.obj):
            fn = self.obj
        if fn is not None:
            fn(state, record)


def _as_callback(obj: Any) -> _Callback:
    return _Callback(obj)


def _train_epoch(state: TrainState, data: TrainData, *, progress: bool, run: Any,
                 hooks: list[_Callback]) -> dict[str, Any]:
    from bayesify.train import resume as ckpt

    bnn = state.bnn
    bnn.train()
    data.set_epoch(state.epoch, start_batch=state.step)
    totals = state.totals or {"loss": 0.0, "nll": 0.0, "kl": 0.0, "count": 0.0, "images": 0.0,
                              "batches": 0.0, "seconds": 0.0}
    state.totals = totals
    start = time.perf_counter() - totals["seconds"]
    bar = tqdm(total=state.steps_per_epoch or None, initial=state.step,
               desc=f"epoch {state.epoch + 1}/{state.epochs}", disable=not progress,
               leave=False, dynamic_ncols=True)
    beta, micro = 0.0, 0
    for x, y in _batches(data, bnn.device, state.channels_last):
        terms = train_step(state, x, y)
        micro += 1
        totals["images"] += x.shape[0]
        totals["batches"] += 1
        bar.update(1)
        if terms is None:
            continue
        beta = terms["beta"]
        for k in ("loss", "nll", "kl"):
            totals[k] += terms[k] * micro
        totals["count"] += micro
        micro = 0
        bar.set_postfix(loss=f"{terms['loss']:.4f}", nll=f"{terms['nll']:.4f}",
                        kl=f"{terms['kl']:.1f}", beta=f"{beta:.2f}")
        mid_epoch = state.steps_per_epoch <= 0 or state.step < state.steps_per_epoch
        if (run.directory is not None and run.every_steps(state) and mid_epoch):
            totals["seconds"] = time.perf_counter() - start
            ckpt.save(state, run)
        for hook in hooks:
            hook.on_step_end(state, terms)
    flushed = _flush_group(state, beta)
    if flushed is not None:
        for k in ("loss", "nll", "kl"):
            totals[k] += flushed[k] * micro
        totals["count"] += micro
    bar.close()
    if totals["batches"] == 0:
        raise BayesifyError("the training loader produced no batches")
    seconds = time.perf_counter() - start
    images = all_reduce_sum(torch.tensor([totals["images"]], dtype=torch.float64),
                            state.ctx).item()
    count = max(totals["count"], 1.0)
    record: dict[str, Any] = {k: totals[k] / count for k in ("loss", "nll", "kl")}
    record.update({
        "epoch": state.epoch + 1,
        "steps": int(totals["batches"]),
        "beta": beta,
        "lr": state.optimizer.param_groups[0]["lr"],
        "seconds": seconds,
        "images_per_second": images / max(seconds, 1e-9),
        "world_size": state.ctx.world_size,
    })
    for group in state.optimizer.param_groups[1:]:
        record[f"lr_{group.get('name', 'group')}"] = group["lr"]
    return record


def _dataset_size(loader: Iterable) -> int:
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        raise BayesifyError("cannot infer N_train from the loader; pass n_train=...")
    return len(dataset)


def _num_batches(loader: Iterable) -> int:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return 0
