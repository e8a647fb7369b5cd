"""What the one epoch driver (``bayesify.fit``) calls: a family's :class:`Step`, the
:class:`FitContext` it hands to every call, and the :class:`Knob` s it tunes.

A family is a config, layers and a step. ``Method.step()`` returns a fresh step; the
driver runs it::

    step.begin(ctx)                      # once, before the first batch (not on resume)
    for epoch: for batch in ctx's shard of the training data:
        step.step(batch, ctx)            # → loss terms when an optimiser step was taken
    record = step.end(ctx)               # once, after the last batch: reduce, finalise
    record |= ctx.tune(method.knobs(bnn))   # with a validation loader

A gradient step calls ``ctx.gradient_step(batch)``: the driver's optimiser, gradient
accumulation, DDP, AMP and finite guard, with the loss ``mean NLL + β·w_i·KL/N_train``
built from the step's :meth:`Step.terms` and :meth:`Step.kl_weight`, and the step's
:meth:`Step.before_update` / :meth:`Step.after_update` around every optimiser step.
Steps of the kit (:mod:`bayesify.kit.steps`): ``ElboStep``, ``SnapshotStep``,
``CurvatureStep``; a family may write its own.

Whatever must survive a resume lives in ``bnn.state`` or the layers' buffers (the step
object is rebuilt by every ``fit`` call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from bayesify.core.batch import Batch, batch_rows, call_model
from bayesify.core.outputs import logits_of

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


@dataclass(frozen=True)
class Knob:
    """A predictive-scale knob a family declares and the driver tunes on validation data.

    ``name``: the ``bnn.state`` / record name; ``grid``: the values searched (a family
    declares its own); ``meaning``: what the value does, in words; ``set``: installs a
    value; ``prefer``: ``"largest"`` or ``"smallest"`` — the grid end that is the
    broadest posterior, which the selection rule (:func:`bayesify.core.selection.choose_joint`)
    favours among equally good values; ``rule``: ``"shift"`` (the default: the lowest NLL on
    shifted validation inputs among values the clean split cannot tell from the calibrated
    starting network) or ``"min"`` (the lowest clean validation NLL) — chosen jointly with
    the temperature either way; ``initial``: installed by ``fit`` before the first step (``None``:
    left as it is); ``settle``: called once after the chosen value is installed,
    returning extra record entries (e.g. statistics that depend on the value); ``sharpens``:
    the knob spans a GLM (Laplace) spread whose variance grows off the data, so the search
    may sharpen the predictive (T < 1) for values that need it, whatever the family
    (:func:`bayesify.train.tuning.search_knobs`; member-wise Laplace heads);
    ``grid_log_probs``: for a knob whose values leave the network's forward unchanged (a
    GLM prior precision), every grid value's ``[B, C]`` predictive log-probabilities (T = 1)
    of one input batch from one forward, so the search streams the split once for the whole
    grid instead of once per value (``None``: ``set`` each value and predict); ``walk``:
    the search may walk a long grid coarse to fine (:class:`bayesify.train.tuning._KnobWalk`:
    every other value, then around its choice and the feasibility edge) — for a knob whose
    predictive moves continuously with the value under the search's fixed noise (a
    multiplier of a learned std or of member logits) and whose search costs enough to be
    worth it; ``False``: every value is scored (a dropout rate, along which the clean NLL is
    jagged: a mask flips as the rate crosses its draw; the epinet, whose whole fit costs
    1–2 % of a deep ensemble's training); ``one_sample_at``: a value at which every sample
    of a posterior component is the same network (a spread multiplier at 0: the component
    means), so the search predicts it with one sample per component instead of the
    predictor's S — the same predictive to rounding, at 1/S of the cost (``None``: none);
    ``broad_limit``: ``True`` when the broadest grid value already gives the posterior's limit
    (a GLM prior precision far below every curvature eigenvalue: nothing broader changes a
    variance by more than a per cent), so a choice there is not the grid's doing and is
    not warned about (``None``: always warned about); ``widen``: what a user can do when the
    choice sits at the broad end (``None``: the family's grid option or prior, found by the
    driver) — for a knob whose grid is not the family's option.
    """

    name: str
    grid: tuple[float, ...]
    meaning: str
    set: Callable[[float], None]
    prefer: str = "largest"
    rule: str = "shift"
    initial: float | None = None
    settle: Callable[[], dict[str, Any]] | None = None
    sharpens: bool = False
    grid_log_probs: Callable[[Any], list[torch.Tensor]] | None = None
    walk: bool = True
    one_sample_at: float | None = None
    broad_limit: Callable[[], bool] | None = None
    widen: str | None = None


@dataclass(frozen=True)
class BatchSource:
    """Inputs of a pass over (a fraction of) the training data, outside the training steps.

    ``batches(fraction)``: inputs-only :class:`~bayesify.core.batch.Batch` es on the
    model's device, the first ``ceil(fraction · batches)`` of this process's share;
    ``mean(t)``: the mean of a statistic over the processes sharing the pass (identity
    in a single process). ``fit`` makes one from its context (SWAG's BatchNorm pass);
    a predictor makes one from a loader the caller gives.
    """

    batches: Callable[[float], Iterable[Batch]]
    mean: Callable[[torch.Tensor], torch.Tensor] = lambda t: t


class FitContext(Protocol):
    """The services ``fit`` hands to every :class:`Step` call (``bayesify.train.context``)."""

    bnn: BayesianModel
    epoch: int
    epochs: int
    steps_per_epoch: int
    global_step: int
    n_train: int
    optimizer: Any
    base_lrs: list[float]

    @property
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def validating(self) -> bool:
        """Whether ``fit`` got a validation loader (the knobs will be tuned)."""

    def batches(self, fraction: float = 1.0) -> Iterator[Batch]:
        """This process's share of the training data (every example once over the ranks)."""

    def source(self) -> BatchSource:
        """:meth:`batches` and :meth:`all_reduce_mean` as a :class:`BatchSource`."""

    def labelled_rows(self, rows: int) -> list[tuple[Any, torch.Tensor]]:
        """``(model input, labels)`` of this process's share of the first ``rows`` training
        examples over the ranks (whole batches of its shard, at least one)."""

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (a rank that does not answer is named in the error)."""

    def all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor: ...

    def autocast(self) -> AbstractContextManager[Any]:
        """bf16 autocast when ``fit(amp=...)`` is on, else a no-op."""

    def gradient_step(self, batch: Batch) -> dict[str, float] | None:
        """One micro-batch of the driver's optimiser (see the module docstring)."""

    def log(self, **values: Any) -> None:
        """Add values to this epoch's record (history, ``history.jsonl``, callbacks)."""

    def tune(self, knobs: list[Knob]) -> dict[str, Any]:
        """Choose every knob on the validation split (streamed, sharded); the record."""


class Step:
    """One family's part of the epoch driver. Subclass it (or a kit step) and override.

    Declared fit behaviour (checked by ``fit`` before anything changes): ``defaults``
    — fit options set when the caller leaves them at ``None`` (``lr``, ``momentum``,
    ``weight_decay``, ``lr_schedule``, ``optimizer``, ``clip_grad_norm``); ``refused`` —
    options the step cannot honour (an error naming them and ``refusal``);
    ``optimizes`` — whether the driver builds an optimiser, seeds the data order and runs
    the model in train mode (``False``: a statistics pass, in eval mode, over every
    example exactly once); ``trains_posterior`` — whether those optimiser steps train the
    posterior itself (ELBO families), so ``fit`` warns when it barely moved;
    ``trains_nothing`` — the posterior is complete before ``fit`` (post-hoc MC dropout): its
    pass gathers no statistics and ``fit`` is the validation search.
    """

    defaults: Mapping[str, Any] = {}
    refused: tuple[str, ...] = ()
    refusal: str = "they do not apply to this family"
    optimizes: bool = False
    trains_posterior: bool = False
    trains_nothing: bool = False

    # -- the batch layout and loss -----------------------------------------------------
    def forward(self, bnn: BayesianModel, inputs: Any,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[R, C]`` and targets ``[R]`` of one training batch (default: the batch
        as it is, every row component 0)."""
        rows = batch_rows(inputs)
        with bnn.context.use(torch.zeros(rows, dtype=torch.long, device=labels.device)):
            return logits_of(call_model(bnn.model, inputs)), labels

    def terms(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean NLL over the step's rows, KL)`` of one batch, fp32 (KL 0 by default)."""
        with bnn.context.use(None, generator=generator):
            logits, targets = self.forward(bnn, inputs, labels)
        nll = F.cross_entropy(logits.float(), targets)
        return nll, torch.zeros((), device=nll.device)

    def kl_weight(self, index: int, total: int) -> float:
        """``w_i``: multiplier of ``KL/N_train`` at optimiser step ``index`` of ``total`` in
        an epoch (``total`` 0 when the epoch length is unknown); 1 by default."""
        return 1.0

    def param_groups(self, bnn: BayesianModel, *, lr: float,
                     weight_decay: float) -> list[dict[str, Any]]:
        """Optimiser groups of the posterior (the driver adds the base group); default: one
        group ``"posterior"`` of every trainable posterior tensor at ``lr``."""
        posterior = [p for p in bnn.posterior_parameters() if p.requires_grad]
        return [{"params": posterior, "lr": lr, "weight_decay": weight_decay, "name": "posterior"}]

    # -- the driver's calls ----------------------------------------------------------------
    def begin(self, ctx: FitContext) -> None:
        """Once before the first batch of a fresh fit (not again on resume)."""

    def step(self, batch: Batch, ctx: FitContext) -> dict[str, float] | None:
        """One batch; the loss terms ``{loss, nll, kl, beta}`` when an optimiser step was
        taken (``None`` otherwise). Default: ``ctx.gradient_step(batch)``."""
        return ctx.gradient_step(batch)

    def before_update(self, ctx: FitContext) -> None:
        """Before the first micro-batch of every optimiser step (e.g. a cyclic LR)."""

    def after_update(self, ctx: FitContext) -> None:
        """After every optimiser step (e.g. collect the iterate)."""

    def end(self, ctx: FitContext) -> dict[str, Any]:
        """Once after the last batch: reduce, finalise; returns entries of the last record."""
        return {}

    def ready(self, bnn: BayesianModel) -> bool:
        """Whether ``bnn`` holds a posterior to predict with and tune. Families whose posterior
        only exists after ``fit`` (SWAG's moments, Laplace's curvature) say ``False`` before
        it; ``bayesify.tune`` then refuses (a custom training loop cannot build them)."""
        return True
