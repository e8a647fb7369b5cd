"""What the epoch driver reports: history log, callbacks, the starting network's metrics.

``history.jsonl`` (rank 0) gets one JSON record per epoch; callbacks are objects with
optional ``on_step_end(ctx, terms)`` / ``on_epoch_end(ctx, record)`` (a plain callable
is ``on_epoch_end``); a fit that ends clearly worse than its starting network warns
(validation: :func:`warn_if_worse`; training NLL and a posterior that did not move:
:class:`FitWatch`).
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bayesify.core.batch import BatchFn, call_model
from bayesify.core.outputs import logits_of
from bayesify.predict.predictor import ModelPredictor
from bayesify.train import evaluate as evaluation
from bayesify.train.distributed import DistContext

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)


def starting_metrics(bnn: BayesianModel, val_loader: Iterable, ctx: DistContext, *,
                      batch_fn: BatchFn | None, amp: bool,
                      progress: bool = True) -> dict[str, float]:
    """Validation accuracy and NLL of the network the fit starts from (the base)."""
    base = ModelPredictor(bnn.unwrap().eval())
    base.batch_fn = batch_fn
    metrics = evaluation.evaluate_sharded(base, val_loader, ctx, amp=amp, batch_fn=batch_fn,
                                          progress=progress, desc="validate the start")
    return {k: metrics[k] for k in ("accuracy", "nll", "n") if k in metrics}


def worse_advice(family: str, refused: tuple[str, ...] = ()) -> str:
    """What to try after a fit that ended worse than its start: only the fit options the
    family's step honours (Laplace refuses ``lr`` and ``epochs``: one pass, no optimiser)."""
    if "lr" in refused or "epochs" in refused:
        return (f"{family!r} is fitted by one pass with no learning rate or epochs; its own "
                f"options decide the posterior (see `bayesify methods {family}`), or keep the "
                "starting network")
    return ("try a lower lr, fewer epochs, or a smaller initial posterior spread "
            f"(see `bayesify methods {family}`)")


def warn_if_worse(family: str, start: dict[str, float], last: dict[str, Any], *,
                  refused: tuple[str, ...] = ()) -> None:
    """A fit that ends clearly worse than its starting network says so (and what to try;
    ``refused``: the fit options the family's step cannot honour)."""
    acc, nll = last.get("val_accuracy"), last.get("val_nll")
    if acc is None or nll is None or "accuracy" not in start:
        return
    worse = []
    if acc < start["accuracy"] - 0.01:
        worse.append(f"accuracy {acc:.4f} < {start['accuracy']:.4f}")
    if nll > start["nll"] * 1.1 + 1e-3:
        worse.append(f"NLL {nll:.4f} > {start['nll']:.4f}")
    if worse:
        warnings.warn(
            f"fit of {family!r} ended with validation {' and '.join(worse)} of the starting "
            f"network; {worse_advice(family, refused)}", stacklevel=3,
        )


class FitWatch:
    """What a fresh fit compares at its end with its start; rank 0 warns, naming the family
    and the fix.

    - **Training NLL far above the start's**: the mean training NLL of the last epoch
      exceeds the starting network's mean NLL on the first :attr:`START_BATCHES` training
      batches of the first epoch by more than :attr:`NLL_MARGIN` nats (1 nat: the
      posterior gives the true labels under 1/e of the start's probability on average).
      That NLL is the samples' mean, ``E_q[−log p(y|x, θ)]``, which the loss trains; the
      predictive's, ``−log E_q[p(y|x, θ)]``, is below it (Jensen), by the most where a
      network's logits are large (an over-confident MAP: a sample that moves a logit ×20
      is confidently wrong). Where the fit measured its predictive against the start and
      it kept the start's accuracy (``predictive``: on validation, or on training examples
      without it), the gap is the samples' spread, not a broken fit, and it is logged:
      the stress matrix's logit-×20 network warned "much worse than the network it
      started from" for four families whose predictive was 3–6 points *more* accurate.
    - **A posterior that barely moved**: ``‖θ_end − θ_begin‖ / ‖θ_begin‖ <`` :attr:`MOVED_TOL`
      over the tensors the optimiser trains, for families whose step trains its posterior
      by gradient (``Step.trains_posterior``: not SWAG's / snapshot ensembles' SGD iterates,
      not Laplace's curvature pass). Not after a resume (the run moved before it), and not
      when the last epoch's mean training NLL is below :attr:`LEARNED` × the start's: a
      large network fine-tuned moves its weights little and its predictions a lot (a
      MobileNetV3's ensemble: relative change 0.00043 in 76 steps, training NLL 0.0073 →
      0.0012, validation NLL 0.158 → 0.121 — the warning told the user to raise lr).
      Where the caller left ``lr`` and the budget (``epochs``, ``min_steps``) to the
      family's defaults it is logged, not warned about: those defaults are the measured
      ones, and raising them is what made posteriors diverge (on the image protocols'
      networks, which fit their training images to a mean NLL near 0.002, the gradient
      has little to say: hypernet's generators moved 1e-5 relative in 77 steps, abnn's
      1e-4 in 287, the ensemble's 7e-4, each with the validation search setting the spread
      afterwards — 15 of the 72 default fits of both quality protocols at the last stop
      said "raise lr or epochs").
    """

    START_BATCHES = 4
    NLL_MARGIN = 1.0
    MOVED_TOL = 1e-3
    LEARNED = 0.5

    def __init__(self, state: Any, *, fresh: bool, chosen: bool = True) -> None:
        """``chosen``: whether the caller set ``lr`` or the budget (else the family's
        defaults ran, and a posterior that barely moved is logged)."""
        step, optimizer = state.family, state.optimizer
        self.fresh, self.start_step, self.chosen = fresh, state.global_step, chosen
        trained = (fresh and optimizer is not None and step is not None
                   and getattr(step, "trains_posterior", False))
        self.tensors = ([p for g in optimizer.param_groups if g.get("name") != "base"
                         for p in g["params"]] if trained else [])
        self.begin = [p.detach().clone() for p in self.tensors]
        self.start_nll: list[float] = []
        self.base = state.bnn.unwrap().eval() if fresh and optimizer is not None else None

    @torch.no_grad()
    def see(self, batch: Any) -> None:
        """One training batch of the first epoch: the starting network's NLL on it."""
        if self.base is None:
            return
        logits = logits_of(call_model(self.base, batch.model_input())).float()
        self.start_nll.append(F.cross_entropy(logits, batch.labels).item())
        if len(self.start_nll) >= self.START_BATCHES:
            self.base = None  # the copy of the base network is not kept

    def finish(self, state: Any, family: str, *, predictive: str | None = None) -> None:
        """``predictive``: what the fit measured of its predictive against the start where
        it kept the start's accuracy (:func:`bayesify.train.best.kept_accuracy`), else
        ``None``."""
        self.base = None
        if not state.ctx.is_main or not self.fresh or not state.history:
            return
        steps = state.global_step - self.start_step
        last = state.history[-1].get("nll")
        learned = False
        if self.start_nll and last is not None and math.isfinite(last):
            start = sum(self.start_nll) / len(self.start_nll)
            learned = last < self.LEARNED * start
            if last > start + self.NLL_MARGIN and predictive is not None:
                logger.info(
                    "fit of %r: the mean training NLL of the posterior's samples in the last "
                    "epoch, %.3f, is more than %g nat above the starting network's (%.3f); "
                    "their average, the predictive, is as accurate as the start or more (%s): the "
                    "samples' spread, not a broken fit", family, last, self.NLL_MARGIN, start,
                    predictive)
            elif last > start + self.NLL_MARGIN:
                warnings.warn(
                    f"fit of {family!r}: the mean training NLL of the last epoch, {last:.3f}, "
                    f"is more than {self.NLL_MARGIN:g} nat above the starting network's on the "
                    f"first training batches ({start:.3f}): the posterior predicts the training "
                    "labels much worse than the network it started from; try a lower lr or a "
                    f"smaller initial posterior spread (see `bayesify methods {family}`)",
                    stacklevel=3)
        if self.tensors and steps > 0 and not learned:
            moved = math.sqrt(sum(float((p.detach() - b).pow(2).sum())
                                  for p, b in zip(self.tensors, self.begin)))
            size = math.sqrt(sum(float(b.pow(2).sum()) for b in self.begin))
            relative = moved / max(size, 1e-12)
            if relative <= self.MOVED_TOL and not self.chosen:
                logger.info(
                    "the posterior of %r stayed within %.2g (relative) of its initialisation "
                    "in %d optimiser steps at its default lr and budget: the training data "
                    "moved it little; its spread is what the validation search sets",
                    family, relative, steps)
            elif relative <= self.MOVED_TOL:
                warnings.warn(
                    f"the posterior of {family!r} barely moved from its initialisation in "
                    f"{steps} optimiser steps (relative change {relative:.2g} "
                    f"< {self.MOVED_TOL:g}); raise lr or epochs", stacklevel=3)


class HistoryLog:
    """``history.jsonl`` in ``log_dir`` (rank 0 only): one JSON record per epoch."""

    def __init__(self, log_dir: str | Path | None, ctx: DistContext) -> None:
        self.path = Path(log_dir) / "history.jsonl" if log_dir is not None and ctx.is_main else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record, default=float) + "\n")


class Callback:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def on_step_end(self, state: Any, terms: dict[str, float]) -> None:
        fn = getattr(self.obj, "on_step_end", None)
        if fn is not None:
            fn(state, terms)

    def on_epoch_end(self, state: Any, record: dict[str, Any]) -> None:
        fn = getattr(self.obj, "on_epoch_end", None)
        if fn is None and callable(self.obj):
            fn = self.obj
        if fn is not None:
            fn(state, record)


def as_callback(obj: Any) -> Callback:
    return Callback(obj)
