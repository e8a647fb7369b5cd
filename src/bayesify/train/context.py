"""The fit context: the epoch driver's state and the services it hands to every step.

:class:`TrainContext` implements :class:`bayesify.core.fitting.FitContext`. It is the
one place that iterates training data: the driver's epochs (:meth:`train_batches`, the
seeded, sharded :class:`~bayesify.train.data.TrainData`), a step's extra pass over
this rank's share of it (:meth:`batches`, e.g. SWAG's BatchNorm statistics) and the
validation stream of the knob search (:meth:`val_batches`). Reductions go through
:mod:`bayesify.train.distributed` (a rank that does not answer is named); gradient
steps go through :mod:`bayesify.train.steps` (optimiser, accumulation, DDP, AMP,
finite guard). Callbacks receive this object (``TrainState`` is its old name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.batch import Batch, BatchFn, replayed_order
from bayesify.core.fitting import BatchSource, Knob, Step
from bayesify.train import steps
from bayesify.train.data import (
    TrainData,
    epoch_batches,
    first_rows,
    shard_batches,
    whole_batches,
)
from bayesify.train.distributed import DistContext, all_reduce_mean, all_reduce_sum
from bayesify.train.tuning import installed_scores, search_knobs

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


@dataclass
class TrainContext:
    bnn: BayesianModel
    optimizer: torch.optim.Optimizer | None
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
    #: the family's step the driver runs (default: ``bnn.method.step()``)
    family: Step | None = None
    #: the training data of every epoch and the caller's loaders
    data: TrainData | None = None
    train_loader: Iterable | None = None
    val_loader: Iterable | None = None
    #: labelled inputs under the expected shift (the search's robustness signal)
    shift_loader: Iterable | None = None
    batch_fn: BatchFn | None = None
    #: whether the driver shows progress bars (the knob search's too)
    show_progress: bool = False
    #: the warnings of the latest knob search, held back until fit knows whether the state
    #: they were said about is the one it hands back (``loop._search``)
    search_warnings: list[Any] = field(default_factory=list)
    #: the latest knob search's per-example shifted validation NLL of its choice (``"shift"``)
    search_scores: dict[str, torch.Tensor] = field(default_factory=dict)
    #: values steps logged for the current epoch's record
    logged: dict[str, Any] = field(default_factory=dict)
    #: what the never-worse rules hold of the fit's start (``best``: :class:`BestState`,
    #: ``start_guard``: :class:`StartGuard`), each with ``carry() -> (numbers, tensors)``:
    #: written into every checkpoint so that a resumed fit ends as the uninterrupted one
    carried: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.family is None:
            self.family = self.bnn.method.step()

    # -- where and when --------------------------------------------------------------------
    @property
    def progress(self) -> float:
        """Epochs done, fractional: the argument of every schedule."""
        group_start = (self.step // self.grad_accum_steps) * self.grad_accum_steps
        return self.epoch + group_start / max(self.steps_per_epoch, 1)

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def validating(self) -> bool:
        return self.val_loader is not None

    def trainable(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # -- data: the one place that iterates it ------------------------------------------------
    def train_batches(self) -> Iterator[Batch]:
        """The current epoch's batches of this rank (see :class:`TrainData`), on the device."""
        assert self.data is not None
        return epoch_batches(self.data, device=self.bnn.device, batch_fn=self.batch_fn,
                             channels_last=self.channels_last)

    def batches(self, fraction: float = 1.0) -> Iterator[Batch]:
        """Inputs of the first ``ceil(fraction · n)`` batches of this rank's contiguous,
        unpadded shard of the training loader (every example once over the ranks)."""
        if self.train_loader is None:
            raise RuntimeError("this fit context has no training loader")
        return shard_batches(self.train_loader, self.ctx, device=self.bnn.device,
                             batch_fn=self.batch_fn, fraction=fraction)

    def source(self) -> BatchSource:
        """The training batches for passes outside the steps (SWAG's BatchNorm statistics),
        in the same order at every pass (:func:`~bayesify.core.batch.replayed_order`)."""
        return BatchSource(batches=lambda fraction=1.0: replayed_order(
            self.batches(fraction), self.train_loader, self.bnn.device), mean=self.all_reduce_mean)

    def labelled_rows(self, rows: int) -> list[tuple[Any, torch.Tensor]]:
        """``(model input, labels)`` of this rank's share (``ceil(rows / world size)``) of
        its contiguous shard of the training loader: whole batches, at least one."""
        if self.train_loader is None:
            raise RuntimeError("this fit context has no training loader")
        return first_rows(shard_batches(self.train_loader, self.ctx, device=self.bnn.device,
                                        batch_fn=self.batch_fn),
                          -(-rows // max(self.ctx.world_size, 1)))

    def val_batches(self) -> Iterator[Batch]:
        """This rank's shard of the validation loader, one batch at a time, on the device."""
        if self.val_loader is None:
            raise RuntimeError("fit got no validation loader")
        return shard_batches(self.val_loader, self.ctx, device=self.bnn.device,
                             batch_fn=self.batch_fn)

    # -- reductions, AMP, logging --------------------------------------------------------------
    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(values, self.ctx)

    def all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_mean(values, self.ctx)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)

    def log(self, **values: Any) -> None:
        self.logged.update(values)

    # -- optimisation and the knob search --------------------------------------------------------
    def gradient_step(self, batch: Batch) -> dict[str, float] | None:
        return steps.train_step(self, batch)

    def whole_val_batches(self) -> Iterator[Batch]:
        """The whole validation loader as one process streams it (the shift signal's
        calibration on the main process: the same on any number of ranks)."""
        if self.val_loader is None:
            raise RuntimeError("fit got no validation loader")
        return whole_batches(self.val_loader, device=self.bnn.device, batch_fn=self.batch_fn)

    def shift_batches(self) -> Iterator[Batch]:
        """This rank's shard of the shift loader, one batch at a time, on the device."""
        if self.shift_loader is None:
            raise RuntimeError("fit got no shift loader")
        return shard_batches(self.shift_loader, self.ctx, device=self.bnn.device,
                             batch_fn=self.batch_fn)

    def tune(self, knobs: list[Knob], *, keep: tuple[torch.Tensor, torch.Tensor] | None = None,
             start: dict[str, Any] | None = None) -> dict[str, Any]:
        return search_knobs(self.bnn, knobs, self.val_batches, self.ctx,
                            shift_batches=self.shift_batches if self.shift_loader is not None
                            else None, progress=self.show_progress and self.is_main, keep=keep,
                            start=start, whole_split=self.whole_val_batches,
                            scores=self.search_scores)

    def clean_scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n]`` per-example clean validation NLL and error of the predictive as it is now."""
        return installed_scores(self.bnn, self.val_batches, self.ctx)


#: the old name (callbacks and custom loops receive / build it)
TrainState = TrainContext
