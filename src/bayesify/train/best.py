"""Never worse than the start: the best validated state a fit hands back.

A fit with a ``val_loader`` validates the network it starts from (the base, through
:func:`~bayesify.train.hooks.starting_metrics`) and its posterior at the end of validated
epochs. When the last validation is *clearly worse* than the start (:func:`clearly_worse`:
NLL more than 10 % higher, or accuracy more than one point lower with an NLL no better),
or when the validation search found no feasible candidate (:func:`infeasible`: its
choice is more than 0.005 nats of clean NLL above the start at the start's best
temperature; :func:`accuracy_lost`: it is more than the search's one point of accuracy below
the start), the fit does not hand that state back: of the last state, the best earlier
validated epoch and the state it began with (validated then, only in this case), it keeps
the one with the lowest validation NLL among those within the accuracy tolerance (all, if
none is), logs which, and marks the last history record::

    {"kept": "last" | "epoch 3" | "start", "kept_val_nll": ..., "kept_val_accuracy": ...,
     "worse_than_start": bool}

``worse_than_start`` is true when even the kept state is clearly worse than the starting
network: ``bayesify fit`` and ``examples/finetune_imagenet.py`` then exit non-zero, and
``bayesify calibrate`` refuses the run (a temperature would only hide the collapse).

Earlier states are kept for families whose optimiser steps train the posterior itself
(``Step.trains_posterior``: the ELBO families, dropout and deep ensembles included). A step
whose initial posterior is not the network (iBNN's means spread around 1) says which entries
make it so (``step.network_state(bnn)``); the start candidate is then the network itself. A step
that builds its posterior from the whole trajectory (SWAG) is not rewound step by step; when
it says what its starting network is as a posterior (``step.start_state(bnn)``: ``state_dict``
entries, e.g. SWAG's θ̄ = θ₀ with zero spread and the pretrained BatchNorm statistics), that
start is the candidate beside the last state. Other steps are marked and warned about. A
fresh fit, and a fit resumed from a checkpoint that holds what the rule had seen
(:meth:`BestState.carry`: the start's validation metrics, the starting and best states),
which then ends as the uninterrupted one; a checkpoint without it (written by an older
bayesify) resumes without the rule.

A lower accuracy with a better NLL is not "clearly worse" when it is what a few validation
examples near the decision boundary give: at most max(:data:`FLIPPED_EXAMPLES`, two binomial
standard deviations 2·√(n·a·(1−a))) of the ``n`` examples the start was validated on (``a``
its accuracy); a larger drop is, whatever the NLL (an over-confident start can have a worse
NLL than a posterior at a fraction of its accuracy).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from bayesify.core.selection import ACCURACY_TOLERANCE, CLEAN_TOLERANCE
from bayesify.kit import laplace_heads
from bayesify.train import evaluate as evaluation
from bayesify.train.hooks import worse_advice

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)

#: how much worse than the start counts as "clearly": one accuracy point, 10 % NLL
ACCURACY_MARGIN = 0.01
NLL_FACTOR = 1.1
#: an accuracy drop of at most this many validation examples (or two binomial standard
#: deviations, when more) is forgiven when the NLL is better
FLIPPED_EXAMPLES = 2
#: paired standard errors of the per-example shifted validation NLL by which the starting
#: network with Laplace heads must beat a feasible trained state to be handed back instead
#: (:meth:`BestState.retry_start`)
START_SHIFT_SE = 1.0


def clearly_worse(start: dict[str, float], metrics: dict[str, Any], *,
                  prefix: str = "val_") -> list[str]:
    """What makes ``metrics`` (``val_accuracy``, ``val_nll``) clearly worse than ``start``
    (``accuracy``, ``nll``), as readable comparisons; empty when it is not."""
    acc, nll = metrics.get(f"{prefix}accuracy"), metrics.get(f"{prefix}nll")
    if acc is None or nll is None or "accuracy" not in start or "nll" not in start:
        return []
    worse = []
    nll_worse = not math.isfinite(nll) or nll > start["nll"] * NLL_FACTOR + 1e-3
    # a lower accuracy with a better NLL is what a few validation examples near the
    # decision boundary give (1 of 3 images flipped): worse only when the NLL is not better,
    # or when more than a few examples flipped (``n`` known: 0.90 → 0.55 on 300 images with
    # an NLL below an over-confident start's is worse)
    drop, n = start["accuracy"] - acc, start.get("n")
    noise = (max(FLIPPED_EXAMPLES, 2 * math.sqrt(n * start["accuracy"] * (1 - start["accuracy"])))
             if n else math.inf)
    flipped = drop * (n or 0) > noise + 1e-6
    if drop > ACCURACY_MARGIN and (nll_worse or nll >= start["nll"] or flipped):
        worse.append(f"accuracy {acc:.4f} < {start['accuracy']:.4f}")
    if nll_worse:
        worse.append(f"NLL {nll:.4f} > {start['nll']:.4f}")
    return worse


def kept_accuracy(record: dict[str, Any], start: dict[str, float] | None) -> str | None:
    """Where a fit measured its predictive against the starting network and it kept the
    start's accuracy: what was measured, as a phrase; else ``None``. With validation
    (``start``: the start's validation metrics) the last state is not :func:`clearly_worse`;
    without it, its accuracy on the start guard's training examples
    (:mod:`bayesify.train.start_guard`) is within :data:`ACCURACY_MARGIN` of the start's."""
    acc = record.get("val_accuracy")
    if start is not None and acc is not None and "accuracy" in start:
        if clearly_worse(start, record):
            return None
        return f"validation accuracy {acc:.4f} against {start['accuracy']:.4f}"
    end, begin = record.get("end_train_accuracy"), record.get("start_train_accuracy")
    if end is not None and begin is not None and end >= begin - ACCURACY_MARGIN:
        return f"{end:.4f} on training examples against {begin:.4f}"
    return None


def infeasible(record: dict[str, Any]) -> list[str]:
    """The last state's searched clean validation NLL is above the start's at its best
    temperature by more than the search's tolerance
    (:data:`~bayesify.core.selection.CLEAN_TOLERANCE`): no candidate of the search was
    feasible, so the last state is worse than simply tempering the starting network, and
    the earlier states are candidates too. Empty without a search record."""
    nll, reference = record.get("val_nll"), record.get("start_tempered_val_nll")
    if nll is None or reference is None or not math.isfinite(nll):
        return []
    if nll > reference + CLEAN_TOLERANCE + 1e-6:
        where = "the start at its best temperature"
        return [f"NLL {nll:.4f} > {reference:.4f} + {CLEAN_TOLERANCE:g} ({where})"]
    return []


def accuracy_lost(start: dict[str, float], metrics: dict[str, Any], *,
                  prefix: str = "val_") -> list[str]:
    """``metrics``' validation accuracy is more than the search's accuracy tolerance
    (:data:`~bayesify.core.selection.ACCURACY_TOLERANCE`, at least one example) below the
    start's: the search admits no such candidate, so its choice is one only where none was
    admissible — the state lost accuracy at every spread (MNF on a held-out depthwise CNN:
    0.8500 against 0.8633 on 300 images, with a better NLL). Empty when it is not."""
    acc, start_acc, n = metrics.get(f"{prefix}accuracy"), start.get("accuracy"), start.get("n")
    if acc is None or start_acc is None:
        return []
    allowed = max(ACCURACY_TOLERANCE, 1.0 / n if n else 0.0)
    if start_acc - acc > allowed + 1e-9:
        return [f"accuracy {acc:.4f} < {start_acc:.4f} - {allowed:.3g} (the search's tolerance)"]
    return []


def _above_start(nll: float | None, record: dict[str, Any]) -> bool:
    """:func:`infeasible` for one validation NLL against the record's calibrated start."""
    return bool(infeasible({"val_nll": nll,
                            "start_tempered_val_nll": record.get("start_tempered_val_nll")}))


def _rescued_by_heads(record: dict[str, Any]) -> bool:
    """The family's own searched state (``family_val_nll``, before member-wise Laplace heads)
    was infeasible: only the heads made the state feasible."""
    return _above_start(record.get("family_val_nll"), record)


def searched_better(search: dict[str, Any], metrics: dict[str, float],
                    record: dict[str, Any]) -> bool:
    """Whether a searched state (``search``, its validation ``metrics``) beats the one the
    history ``record`` keeps, by the knob search's own rule: when both are feasible against
    the calibrated start (:func:`infeasible` of their validation NLL) and both were scored
    under shift, the lower shifted validation NLL (the same examples under the same
    perturbations: the shift signal is calibrated on the start once); a feasible one over an
    infeasible one; else the lower clean validation NLL. (By clean NLL alone, SWAG on the CNN
    protocol's seed 1 kept its own trained state, rescued by its heads at 0.1244 and shifted
    1.80, over the start with heads at 0.1278 (feasible) and shifted 1.49: 0.98 × the start's
    shift NLL on test, 0.79 × with this rule.)"""
    def feasible(nll: float | None) -> bool:
        return nll is not None and math.isfinite(nll) and not _above_start(nll, record)

    new_ok, old_ok = feasible(metrics["val_nll"]), feasible(record["kept_val_nll"])
    new_shift = search.get("val_shift_nll")
    old_shift = record.get("kept_val_shift_nll", record.get("val_shift_nll"))
    if new_ok and old_ok and new_shift is not None and old_shift is not None:
        return float(new_shift) < float(old_shift)
    if new_ok != old_ok:
        return new_ok
    return metrics["val_nll"] < record["kept_val_nll"]


def adopt_search(record: dict[str, Any], search: dict[str, Any],
                 metrics: dict[str, float]) -> None:
    """Write a kept state's search (its knobs and T; the record's ``val_*`` stay the last
    state's) and its validation ``metrics`` into the last history ``record``."""
    record.update({k: v for k, v in search.items() if not k.startswith(("val_", "start_"))})
    if "val_shift_nll" in search:
        record["kept_val_shift_nll"] = search["val_shift_nll"]
    record.update({"kept_val_nll": metrics["val_nll"],
                   "kept_val_accuracy": metrics["val_accuracy"]})


def _snapshot(bnn: BayesianModel, device: str | None = None) -> dict[str, torch.Tensor]:
    """Copies of every tensor a fit can change (trainable parameters and all buffers), on
    ``device`` (``None``: where they are)."""
    frozen = {name for name, p in bnn.named_parameters() if not p.requires_grad}
    return {k: v.detach().to(device or v.device, copy=True)
            for k, v in bnn.state_dict().items() if k not in frozen}


class BestState:
    """Tracks the best validated state of one fresh fit and hands it back at the end (see
    the module docstring)."""

    def __init__(self, state: Any, start: dict[str, float] | None, *, fresh: bool,
                 batch_fn: Any = None, samples_per_component: int | None = None,
                 carried: tuple[dict[str, Any], dict[str, Any]] | None = None) -> None:
        """``carried``: what :meth:`carry` wrote into the checkpoint a fit resumes from (the
        start's validation metrics in ``start``, the starting and best states); a resumed
        fit with it decides as the uninterrupted one would."""
        step = state.family
        if carried is not None:
            numbers, tensors = carried
            start, fresh = numbers.get("start") or None, True
        self.state, self.start = state, start
        self.active = bool(start) and fresh and state.val_loader is not None
        self.restores = self.active and getattr(step, "trains_posterior", False)
        #: a trajectory family's starting network as a posterior, built only when needed
        self.start_state = (getattr(step, "start_state", None)
                            if self.active and not self.restores else None)
        self.batch_fn, self.samples = batch_fn, samples_per_component
        #: whether retry_start weighs the starting network with Laplace heads against a
        #: feasible trained state (the family has heads): the start is kept until then
        self.weighs_start = self.active and laplace_heads.enabled(state.bnn)
        self.best: dict[str, torch.Tensor] | None = None
        self.best_metrics: dict[str, float] = {}
        self.best_epoch = 0
        if carried is not None:
            self.initial = tensors.get("initial") if self.restores else None
            self.best = tensors.get("best") if self.restores else None
            if self.best is not None:
                self.best_metrics = dict(numbers.get("best_metrics") or {})
                self.best_epoch = int(numbers.get("best_epoch") or 0)
            return
        self.initial = _snapshot(state.bnn) if self.restores else None
        network = getattr(step, "network_state", None)  # the start as the network itself
        if self.initial is not None and network is not None:
            self.initial.update(network(state.bnn))

    def carry(self) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """What a checkpoint holds of this rule, ``(numbers, tensors)``: the start's
        validation metrics, the best earlier epoch's, and (families that restore states)
        the starting and best states on the CPU. Nothing for an inactive rule."""
        if not self.active:
            return {}, {}
        numbers: dict[str, Any] = {"start": dict(self.start or {})}
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        if self.initial is not None:
            tensors["initial"] = {k: v.detach().to("cpu", copy=True)
                                  for k, v in self.initial.items()}
        if self.best is not None:
            numbers.update({"best_metrics": self.best_metrics, "best_epoch": self.best_epoch})
            tensors["best"] = {k: v.detach().to("cpu", copy=True) for k, v in self.best.items()}
        return numbers, tensors

    def see(self, record: dict[str, Any], *, is_last: bool) -> None:
        """After a validated epoch: keep its state when its validation NLL is the best yet
        (not the last epoch's: that state is the one in the model at the end)."""
        nll = record.get("val_nll")
        if not self.restores or is_last or nll is None or not math.isfinite(nll):
            return
        if not self.best_metrics or nll < self.best_metrics["val_nll"]:
            self.best = _snapshot(self.state.bnn)
            self.best_metrics = {"val_nll": nll, "val_accuracy": record.get("val_accuracy", 0.0)}
            self.best_epoch = int(record["epoch"])

    def finish(self, last: dict[str, Any], family: str, *, refused: tuple[str, ...] = ()) -> None:
        """At the end of the fit: keep the last state unless it is clearly worse than the
        start; then the best of (last, best earlier epoch, the beginning); mark ``last``."""
        if not self.active or "val_nll" not in last:
            return
        start, ctx = self.start or {}, self.state.ctx
        kept, metrics = "last", {"val_nll": last["val_nll"],
                                 "val_accuracy": last.get("val_accuracy", 0.0)}
        worse = clearly_worse(start, last) or infeasible(last) or accuracy_lost(start, last)
        if worse and (self.restores or self.start_state is not None):
            candidates = [("last", metrics, None)]
            if self.best is not None:
                candidates.append((f"epoch {self.best_epoch}", self.best_metrics, self.best))
            initial = (self.initial if self.start_state is None
                       else self.start_state(self.state.bnn))
            if initial is not None:
                candidates.append(("start", self._validate(initial), initial))
            # the lowest NLL among the states within the accuracy tolerance, if any is
            eligible = [c for c in candidates if not accuracy_lost(start, c[1])] or candidates
            kept, metrics, tensors = min(eligible, key=lambda c: c[1]["val_nll"])
            if tensors is not None:
                self.state.bnn.load_state_dict(tensors, strict=False)
            self.state.bnn.eval()
        still = clearly_worse(start, metrics)
        last.update({"kept": kept, "kept_val_nll": metrics["val_nll"],
                     "kept_val_accuracy": metrics["val_accuracy"],
                     "worse_than_start": bool(still)})
        self.best = None
        if not self.weighs_start and not infeasible(last) and not _rescued_by_heads(last) \
                and kept == "last":
            self.initial = None  # retry_start will not need the start
        if not ctx.is_main or not worse:
            return
        ended = " and ".join(worse)
        if kept != "last":
            logger.warning("fit of %r: the last state had validation %s of the starting network; "
                           "the fit keeps the state of %s instead (validation accuracy %.4f, "
                           "NLL %.4f at the last state's knobs and temperature; its own are "
                           "searched next)", family, ended, kept, metrics["val_accuracy"],
                           metrics["val_nll"])
        if still:
            warnings.warn(
                f"fit of {family!r} ended with validation {' and '.join(still)} of the starting "
                f"network (kept: {kept}); the posterior is worse than the network it came from; "
                + worse_advice(family, refused), stacklevel=3)

    def start_tensors(self) -> dict[str, torch.Tensor] | None:
        """The state the fit began with (the trajectory family's start as a posterior), or
        None (no validation, a resumed fit, a family that cannot say)."""
        if not self.active:
            return None
        if self.start_state is not None:
            return self.start_state(self.state.bnn)
        return self.initial

    def retry_start(self, record: dict[str, Any], retune: Any, *, neutral: Any = None,
                    measure: Any = None, family_shift: torch.Tensor | None = None,
                    scores: dict[str, torch.Tensor] | None = None) -> None:
        """When the state kept at the end is still infeasible after its search
        (:func:`infeasible` on ``kept_val_nll``), search the starting state too and keep it
        if its searched validation NLL is lower: the states were compared at the last
        state's knobs and temperature, which favours the trained ones (iBNN with batches of
        one kept epoch 34 at 1.031 against a start of 1.003). ``retune()`` runs the search
        on the model's current state and returns ``(record, metrics)``.

        The same where member-wise Laplace heads made a state feasible that was not on its
        own (``family_val_nll`` infeasible): the heads were fitted on the trained state and
        compared with the start without heads, so the start is searched with its heads too
        (the ensemble on the ViT's seed 1 kept trained members at 0.3059 with heads against
        a start at 0.3084 without them, and ended 1.7 points below it on test). The two
        searched states are weighed by the search's own rule (:func:`searched_better`).

        Otherwise, for a family with heads (``neutral``: the search with every knob at its
        neutral value, :func:`~bayesify.train.tuning.neutral_knobs`; ``measure``: the
        validation metrics of the model's state), the trained state kept at the end is
        weighed against the starting network with its heads: :meth:`_start_with_heads`."""
        kept = record.get("kept", "last")
        if kept == "start":
            self.initial = None
            return
        if not (_rescued_by_heads(record) or _above_start(record.get("kept_val_nll"), record)):
            if neutral is not None and kept == "last" and family_shift is not None:
                self._start_with_heads(record, neutral, measure, family_shift, scores or {})
            self.initial = None
            return
        tensors = self.start_tensors()
        self.initial = None
        if tensors is None:
            return
        bnn = self.state.bnn
        current = _snapshot(bnn)
        bnn.load_state_dict(tensors, strict=False)
        search, metrics = retune()
        if searched_better(search, metrics, record):
            adopt_search(record, search, metrics)
            record["kept"] = "start"
            if self.state.ctx.is_main:
                logger.info("fit: the kept state stayed above the calibrated start after its "
                            "search; the searched starting state is better (validation NLL "
                            "%.4f) and is kept", metrics["val_nll"])
        else:
            bnn.load_state_dict(current, strict=False)
        bnn.eval()

    def _start_with_heads(self, record: dict[str, Any], neutral: Any, measure: Any,
                          family_shift: torch.Tensor, scores: dict[str, torch.Tensor]) -> None:
        """The feasible trained state kept at the end against the starting state with its
        heads (:func:`start_with_heads`); when that is kept, validated (``measure()``) for
        the record. (On the ViT protocol's seed 2 the trained states of batchensemble,
        meanfield and MNF ended at 0.70-0.72x the start's test NLL under shift, the first
        two 0.008-0.011 nats over MAP + temperature on clean test data; the start with heads
        at 0.56x and -0.015.)"""
        tensors = self.start_tensors()
        if tensors is None or "val_shift_nll" not in record:
            return
        search = start_with_heads(self.state.bnn, record, tensors, neutral, family_shift,
                                  scores, is_main=self.state.ctx.is_main)
        if search is not None:
            adopt_search(record, search, measure())
            record["kept"] = "start"

    def _validate(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """Validation metrics of ``tensors`` loaded into the model (the current state is
        put back afterwards)."""
        bnn = self.state.bnn
        current = _snapshot(bnn)
        bnn.load_state_dict(tensors, strict=False)
        try:
            metrics = evaluation.evaluate_sharded(
                bnn, self.state.val_loader, self.state.ctx, samples_per_component=self.samples,
                amp=self.state.amp, batch_fn=self.batch_fn, progress=self.state.show_progress,
                desc="validate the starting posterior")
        finally:
            bnn.load_state_dict(current, strict=False)
        return {"val_nll": float(metrics["nll"]), "val_accuracy": float(metrics["accuracy"])}


def starting_state(bnn: BayesianModel) -> dict[str, torch.Tensor]:
    """The state a posterior begins training from, on the CPU, as the never-worse rules see
    it: every tensor a fit can change, with the entries that make the family's members the
    network itself (``step.network_state``: iBNN's means, rank1's and BatchEnsemble's fast
    weights at 1). Take it before a custom loop trains (``elbo_loss``, the Hugging Face
    ``Trainer``) and give it to :func:`bayesify.tune` (``start=``): the trained state is then
    weighed against this start with its Laplace heads, as ``fit`` does."""
    tensors = _snapshot(bnn, device="cpu")
    network = getattr(bnn.method.step(), "network_state", None)
    if network is not None:
        tensors.update({k: v.detach().to("cpu", copy=True) for k, v in network(bnn).items()})
    return tensors


def start_with_heads(bnn: BayesianModel, record: dict[str, Any],
                     tensors: dict[str, torch.Tensor], neutral: Any,
                     family_shift: torch.Tensor | None, scores: dict[str, torch.Tensor], *,
                     is_main: bool = True, if_infeasible: bool = False,
                     caller: str = "fit") -> dict[str, Any] | None:
    """The trained state in ``bnn``, searched with its member-wise Laplace heads (``record``,
    its per-example shifted validation NLL ``family_shift``), against the starting state
    ``tensors`` with its knobs neutral — every member the network itself, with the heads:
    the ``laplace`` family's posterior in this family's form — searched the same way
    (``neutral()``, returning its record; ``scores["shift"]`` then holds its per-example
    shifted validation NLL). The start is kept when it is feasible (its searched clean
    validation NLL) and its shifted validation NLL is lower by more than
    :data:`START_SHIFT_SE` paired standard errors (``if_infeasible``: or when the trained
    state is not feasible itself). Then the model holds the start with its search's choice
    and its search record is returned; else the trained state is put back and ``None``
    returned. ``record`` gets what was compared either way: ``start_heads_val_nll``,
    ``start_heads_val_shift_nll``, ``start_heads_shift_z``. ``caller`` names the function
    in the logged warning (``"fit"``, ``"tune"``)."""
    if family_shift is None:
        return None
    family_shift = family_shift.clone()
    current = _snapshot(bnn)
    bnn.load_state_dict(tensors, strict=False)
    search = neutral()
    start_shift = scores.get("shift")
    adopt = False
    if start_shift is not None and start_shift.shape == family_shift.shape:
        d = (start_shift - family_shift).double()
        z = float(d.mean() / (d.std() / len(d) ** 0.5).clamp_min(1e-12))
        record.update({"start_heads_val_nll": search.get("val_nll"),
                       "start_heads_val_shift_nll": float(start_shift.mean()),
                       "start_heads_shift_z": z})
        trained_infeasible = if_infeasible and _above_start(record.get("val_nll"), record)
        adopt = (not _above_start(search.get("val_nll"), record)
                 and (z < -START_SHIFT_SE or trained_infeasible))
    if adopt:
        if is_main and record["start_heads_shift_z"] < -START_SHIFT_SE:
            logger.warning(
                "%s: the trained state, searched with its Laplace heads, was worse under "
                "the validation shift (NLL %s) than the starting network with the heads "
                "(%s, %.1f paired standard errors lower): %s hands back the start "
                "with its heads (the `laplace` family's posterior, in this family's form)",
                caller, *apart(float(family_shift.mean()), float(start_shift.mean())),
                -record["start_heads_shift_z"], caller)
        elif is_main:
            logger.warning(
                "%s: the trained state, searched with its Laplace heads, stayed above the "
                "calibrated start on clean validation data (NLL %.4f against %.4f); the "
                "starting network with the heads is feasible (%.4f) and is handed back (the "
                "`laplace` family's posterior, in this family's form)",
                caller, record.get("val_nll"), record.get("start_tempered_val_nll"),
                search.get("val_nll"))
        bnn.eval()
        return search
    bnn.load_state_dict(current, strict=False)
    bnn.eval()
    return None


def apart(a: float, b: float, digits: int = 4) -> tuple[str, str]:
    """``a`` and ``b`` with ``digits`` decimals, or as many more (up to 8) as it takes for
    the two to read differently: a message that says one number is lower must not print
    the same number twice (0.0311 against 0.0311)."""
    for d in range(digits, 9):
        pair = f"{a:.{d}f}", f"{b:.{d}f}"
        if pair[0] != pair[1]:
            break
    return pair
