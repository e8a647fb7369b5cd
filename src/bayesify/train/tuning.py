"""The knob search: every declared knob and the predictive temperature, chosen together on
streamed, sharded validation batches, with a robustness signal the clean split cannot give.

A clean validation split cannot see shift: searched on it alone, every posterior's spread
shrinks until the predictive is the starting network again (measured on held-out networks:
knobs chosen at ×0.1–×0.25, validation epistemic 0.0002–0.02 nats). So the search scores
every candidate twice:

* **clean**: the per-example NLL on the validation split; a candidate is *feasible* when the
  split cannot tell it from the starting network at its own best temperature (within one
  paired standard error of start + temperature scaling) and vouches that it gives up at most
  0.005 nats (:data:`bayesify.core.selection.CLEAN_TOLERANCE`, 1.5 SE above its mean, and
  without its k most favourable examples: :func:`~bayesify.core.selection.favourable_examples`),
  and its clean validation accuracy is at most one point below the start's
  (:data:`~bayesify.core.selection.ACCURACY_TOLERANCE`);
* **shifted**: the per-example NLL on shifted copies of the same inputs — the user's
  ``shift_loader`` when given, else the library's perturbations
  (:mod:`bayesify.train.shift`: noise, masking and mixing at the strength that halves the
  starting network's accuracy above chance), each kind on every third example in turn
  (:func:`interleaved`: one shifted pass per candidate, not one per kind).

Among feasible (knob value, temperature) pairs the one with the lowest shifted NLL is
chosen (:func:`bayesify.core.selection.choose_joint`); ties go to the broadest posterior
(``knob.prefer``). Where a feasible choice's temperature is also that value's lowest clean
NLL on the grid (the shift did not bind), it is refined between its grid neighbours
(:func:`refined_temperature`; the record keeps the grid's value as ``temperature_on_grid``).
A value costs a pass over the split each (clean; shifted only where some
temperature makes it feasible), so a grid of more than :data:`FULL_GRID` values is walked
coarse to fine (:class:`_KnobWalk`; ``Knob.walk``): every other value, then the unscored
neighbours of the choice and of the broadest feasible value until they have none. The temperature acts on the predictive's log-probabilities
(``softmax(log p̄ / T)``, :meth:`~bayesify.core.prediction.Prediction.scaled`) and is searched
on :data:`TEMPERATURES` (0.05 to 16, log grid) for families whose spread is larger off the
data (``sharpens_predictive`` on the family class: Laplace — a GLM's epistemic variance
grows off the data, so a sharpened broad posterior stays broad there). Every other family
may sharpen only as far as the *starting network* needs (:func:`temperature_floor`): down
to the start's best temperature (or a milder one, :func:`network_floor`) when sharpening the
start there buys more than :data:`~bayesify.core.selection.CLEAN_TOLERANCE` of clean
validation NLL and more than one paired standard error with one more error at the split's
median confidence (:func:`unseen_error`) counted in (an under-confident network, e.g. one trained with a large weight
decay or label smoothing: start 0.47 → 0.29 nats at T ≈ 0.5), else T ≥ 1 (sharpening a broad
posterior to buy back its clean NLL cost shift NLL on the quality protocol: ibnn seed 1,
2.42 → 3.41; benchmarks/results/issue29.md). Laplace goes below that floor only for a τ
that is not feasible above it — and never on token inputs (:func:`token_inputs`: a ``[batch, length]``
integer content input), for any family or its heads: on a MiniLM fine-tuned whole
(``benchmarks/protocols.py`` ``minilm-text``) the broad predictives sharpened back to the
start's clean NLL were 1.1–1.6× the start's NLL under held-out wording shifts (typos, dropped
words, paraphrases; benchmarks/results/session20.md), while the search's token
perturbations, at every strength of their ladders, scored them within 0.007 nats of the
start or better. The starting network's reference temperature comes from the network's
own range ("start + temperature scaling"), for every family, and the feasibility rule keeps
only what the clean split can vouch for. The choice is installed as the posterior's temperature
(``bnn.state.temperature``, ``bnn.temperature_source = "search"``, saved and exported with
it; ``calibrate`` refuses to move it without ``force=True``); families without a knob get the
temperature alone.

Every candidate streams the split once, one batch at a time: each rank predicts its
contiguous shard and keeps only per-example NLL on the CPU (8 bytes per example and
temperature); the shards are gathered in rank order, so every rank chooses what a single
process would. The curves go into the record::

    {name: value, f"{name}_grid": [...], f"{name}_val_nll": [...],  # None: not scored
     f"{name}_shift_nll": [...],
     "temperature": T, "temperature_on_grid": the grid's T ("val_nll" is there; T where not refined),
     "start_tempered_val_nll": ..., "shift": {kind: strength} | "shift_loader"}

``fit(val_loader=...)`` runs it after the last epoch; :func:`tune` runs it on its own
(custom loops, the Hugging Face ``Trainer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bayesify.core.batch import Batch, BatchFn, call_model
from bayesify.core.fitting import Knob
from bayesify.core.outputs import logits_of
from bayesify.core.prediction import temper
from bayesify.core.selection import (
    ACCURACY_TOLERANCE,
    CLEAN_TOLERANCE,
    choose_joint,
    favourable_examples,
    feasible,
    log_grid,
)
from bayesify.errors import BayesifyError
from bayesify.kit import laplace_heads
from bayesify.metrics import per_example_nll
from bayesify.progress import progress_bar
from bayesify.train.best import start_with_heads
from bayesify.train.data import shard_batches, whole_batches
from bayesify.train.distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_mean,
    all_reduce_sum,
    broadcast_object,
    current_context,
    naming_unresponsive_ranks,
    rank_zero_warnings,
)
from bayesify.train.shift import ShiftSignal, calibrate_shift, is_content

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)

Batches = Callable[[], Iterator[Batch]]
#: predictive-level temperatures searched with every knob value: 0.05 to 16 on a log grid of
#: ratio ≈ 1.19 with 1 included (a coarser grid left the start 0.003 nats above its
#: temperature-scaled optimum; a network whose logits are 20× its trained ones is best at
#: T ≈ 12). A finer grid (ratio 1.09) was measured and not kept: the start's reference moved
#: by ≤ 0.0024 nats, the search's choices by far more (more temperatures at the feasibility
#: edge to choose from by shifted NLL): on the stress matrix (seed 0, with validation, the 81
#: cells of nine families) the cells over start + temperature + 0.005 on test went from 7 to
#: 14. Sharpening (T < 1) pays off for a broad posterior whose spread is larger off
#: the data (last-layer Laplace at τ = 1, T = 0.1: shift NLL 0.42–0.58× the start's at the
#: start's clean NLL, /work/shared/QUALITY-EVIDENCE.md); the feasibility rule (clean NLL
#: within one paired SE of the calibrated start) keeps it from sharpening a narrow one.
#: The starting network's reference uses the same grid.
TEMPERATURES: tuple[float, ...] = tuple(sorted({*log_grid((0.05, 1.0, 18)),
                                                *log_grid((1.0, 16.0, 17))}))


#: a per-value knob search scores every value of a grid of at most this many values (the
#: member temperatures of ensemble and batchensemble: a walk saved one pass of five and, on the
#: stress matrix, changed two of their 18 cells, one to 0.001 nats over the bar on test); a
#: longer grid coarse to fine (:func:`_first_values`, :func:`_neighbours`)
FULL_GRID = 5
#: False: score every value of every grid (the exhaustive search the coarse-to-fine walk is
#: tested against)
COARSE_TO_FINE = True
#: where the chosen temperature is also its knob value's lowest clean validation NLL on the
#: grid (the shift did not bind) and the choice is feasible, it is refined between its grid
#: neighbours to the vertex of the parabola through the three (log T, mean NLL) points —
#: what temperature scaling does continuously. On the text protocol's seed 2 the grid's step
#: (×1.19) had left six families at T = 1 where temperature scaling's optimum is 1.07,
#: 0.006–0.007 nats over it on test (benchmarks/results/session21.md). Not where nothing was
#: feasible (the search's fallback to the lowest clean NLL): refined, an infeasible trained
#: state came closer to the start and was kept instead of the start, and on the ViT
#: protocol's seed 1 meanfield and SWAG then lost 1.2 and 1.4 points of test accuracy. The
#: starting network's reference stays at its grid temperature: refined too, the start at the
#: neighbouring grid temperatures became infeasible against it (the paired SE of one
#: network's logits at two temperatures is ~0), and dropout on the ViT protocol's seed 1 left
#: the start for a trained rate (+0.021 nats over MAP + TS on test, shift 0.48× → 0.70×).
#: False: the grid's value.
REFINE = True


def token_inputs(batches: Batches) -> bool:
    """Whether the validation inputs are token sequences: a ``[batch, length]`` integer
    tensor among the first batch's content inputs (masks and type ids are not content).
    Reads one batch (the search streams the split once per candidate anyway)."""
    for batch in batches():
        named = [(None, a) for a in batch.args] + list(batch.kwargs.items())
        return any(isinstance(v, torch.Tensor) and v.dim() == 2 and v.dtype != torch.bool
                   and not v.is_floating_point() and not v.is_complex() and is_content(name, v)
                   for name, v in named)
    return False


def sharpening_allowed(bnn: BayesianModel) -> bool:
    """Whether the search may choose T < 1 for ``bnn``'s family (``sharpens_predictive``,
    unless its config's ``sharpen`` option is False)."""
    if not getattr(bnn.method.config, "sharpen", True):
        return False
    return bool(getattr(type(bnn.method), "sharpens_predictive", False))


#: how many paired standard errors the start's gain from sharpening must exceed before a
#: family that does not sharpen may — one, as a candidate's clean cost is judged (the gain
#: is chosen on the split it is measured on; the unseen error of :func:`unseen_error` carries
#: the tail a standard error cannot see). It was 3 until the thirty-second stop; see
#: :func:`network_floor` for what the change bought and cost
UNDER_CONFIDENT_SE = 1.0


def unseen_error(errors: torch.Tensor, runner_up: torch.Tensor) -> torch.Tensor | None:
    """``[T]``: the NLL at every temperature of one error the split did not show — the
    correct example of median margin (top logit − runner-up) labelled as its runner-up
    class. ``errors`` ``[n]``: the start's per-example error; ``runner_up`` ``[T + 1, n]``:
    every example's NLL at every temperature were its label the runner-up class, then its
    margin (:func:`_runner_up_nll`). None when the start gets no example right.

    Why: sharpening's cost on a small split is carried by its few confident errors, a tail
    a paired standard error cannot see when the split happens to hold none. On the CNN
    quality protocol's seed 2 (torch 2.14.1) the start's 6 validation errors were all
    mild; sharpening to T = 0.49 "gained" 0.027 nats at 3.5 SE and cost 0.023 on test
    (18 errors, several confident), and every family sharpened its heads to T = 0.24 and
    ended at 0.97× the start's shift NLL (benchmarks/results/session25.md)."""
    right = (errors < 0.5).nonzero().flatten()
    if right.numel() == 0:
        return None
    margins = runner_up[-1, right]
    median = margins.median()
    pick = right[int((margins - median).abs().argmin())]
    return runner_up[:-1, pick]


def network_floor(start_nll: torch.Tensor | None,
                  unseen: torch.Tensor | None = None) -> float:
    """The starting network's own lowest temperature: its best temperature when it is
    under-confident — sharpening it lowers its mean clean validation NLL against its best
    T ≥ 1 by more than :data:`~bayesify.core.selection.CLEAN_TOLERANCE` and by more than
    :data:`UNDER_CONFIDENT_SE` paired standard errors — else 1. ``start_nll``: the start's
    ``[T, n]`` per-example NLL at every temperature (None: 1); ``unseen`` ``[T]``: one more
    example the split is scored with (:func:`unseen_error`: an error at the split's median
    confidence). The floor is the split's own best temperature where its gain survives that
    error; else the temperature that is best *with* it, where that one's gain does (before
    the thirty-second stop the unseen error only vetted the split's own best: a split best
    at T = 0.17 whose unseen error costs more there than the gain stayed at 1, and lost 0.044
    nats on test to the start at T = 0.49 — ``densenet_ls`` seed 1). Where the split's own
    best passes, the floor is what it was: the milder temperature alone moved the stress
    matrix's weight-decayed networks from T = 0.24 to 0.29, and there 11 of 24 family cells
    ended 0.001–0.026 over the held-out bar (session32.md §3; session25.md found the same).

    Measured (benchmarks/results/session32.md, ``benchmarks/under_confidence.py``): on 255
    validation splits (29 kinds of network × 3 seeds — the held-out architectures, each also
    trained with label smoothing 0.1 as most real pretrained image networks are, the quality
    protocols, the stress matrix — × the whole split, 150 and 100 examples), the start at the
    search's reference temperature was above the start at its validation temperature on test
    (the bar every family is held to: + 0.005) on 86 splits, 60 by more than 0.02 and up to
    0.15 nats, under the rule of the twenty-fifth stop (3 SE, the split's own best only);
    under this one on 27, 3 by more than 0.02, the worst 0.034 (most of the rest within the
    temperature grid's step). The cost is under shift: the start at the reference is ×1.076
    its NLL at T = 1 there (geometric mean over the splits; ×1.029 before). The CNN quality
    protocol's seed 2, the split the unseen error was made for (+0.027 nats at 3.5 SE on
    validation, −0.023 on test at torch 2.14.1), stays at 1.

    Not lower for a smaller gain: measured with the floor at the start's best temperature
    whenever sharpening gained at most the tolerance, the demo's MAP on a validation split it
    separates (NLL 0.005–0.007) is best at T = 0.05, and every family sharpened to it —
    corrupted NLL 6.3 → 26 (iBNN) and 6.4 → 25 (Laplace); the CNN quality protocol's seed 0
    (best at T = 0.84 by < 0.005) gave up 0.004–0.027× the start's shift NLL in every one of
    its twelve families for 0.001–0.002 nats of clean NLL (benchmarks/results/session12.md).
    Nor where the start is best at the grid's lowest temperature: that is a split it separates
    (its NLL falls towards 0 however far it is sharpened), which says nothing about its
    confidence off the split."""
    if start_nll is None:
        return 1.0
    own = int(start_nll.mean(-1).argmin())  # the split's own best temperature
    if own == 0:  # a split the start separates
        return 1.0
    if unseen is not None:  # scored with one more error at the split's median confidence
        start_nll = torch.cat([start_nll, unseen.to(start_nll).view(-1, 1)], dim=1)
    means = start_nll.mean(-1)
    soft = min((i for i, t in enumerate(TEMPERATURES) if t >= 1.0), key=lambda i: means[i])
    for best in dict.fromkeys((own, int(means.argmin()))):  # the split's, else the milder one
        if TEMPERATURES[best] >= 1.0:
            continue
        gain = start_nll[soft] - start_nll[best]  # paired (with the unseen error: n + 1)
        se = float(gain.std() / math.sqrt(gain.numel())) if gain.numel() > 1 else 0.0
        if float(gain.mean()) > max(CLEAN_TOLERANCE, UNDER_CONFIDENT_SE * se):
            return TEMPERATURES[best]
    return 1.0


def temperature_floor(bnn: BayesianModel, floor: float = 1.0) -> float:
    """The lowest temperature the search may give ``bnn``'s predictive, given the starting
    network's own ``floor`` (:func:`network_floor`): the grid's lowest for families that
    sharpen (``sharpens_predictive``; below ``floor`` only for knob values that need it, see
    :func:`search_knobs`), else ``floor`` — a posterior may correct its network's
    under-confidence, never buy back its own breadth."""
    return TEMPERATURES[0] if sharpening_allowed(bnn) else floor


def _at_least(lowest: float) -> list[int]:
    """Indices of :data:`TEMPERATURES` from ``lowest`` up."""
    return [i for i, t in enumerate(TEMPERATURES) if t >= lowest - 1e-12]


def _gather(parts: list[torch.Tensor], ctx: DistContext) -> torch.Tensor:
    """``[T, n]`` from this rank's ``[T, b]`` pieces, every rank's shard in rank order."""
    mine = (torch.cat(parts, dim=1) if parts
            else torch.empty((len(TEMPERATURES) + 1, 0), dtype=torch.float64))
    full = torch.cat(all_gather_objects(mine, ctx), dim=1)
    if full.shape[1] == 0:
        raise BayesifyError("the validation loader produced no batches")
    return full


def _nll_by_temperature(log_probs_at: Callable[[float], torch.Tensor],
                        labels: torch.Tensor) -> torch.Tensor:
    """``[T + 1, B]``: per-example NLL at every temperature of :data:`TEMPERATURES`, then
    the per-example error (1 where the argmax is wrong; a temperature does not move it)."""
    rows = [per_example_nll(log_probs_at(t), labels) for t in TEMPERATURES]
    rows.append((log_probs_at(1.0).argmax(-1) != labels).to(rows[0].dtype))
    return torch.stack(rows).double().cpu()


def _split(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., T + 1, n]`` → NLL ``[..., T, n]`` and error ``[..., n]``."""
    return scores[..., :-1, :], scores[..., -1, :]


def interleaved(copies: list[Batch]) -> Batch:
    """One batch whose row ``r`` is row ``r`` of ``copies[r % len(copies)]``: every kind of
    perturbation on a third of the examples (in turn), so a candidate costs one shifted
    pass instead of one per kind; the mean over the split estimates the mean over kinds,
    and every candidate sees the same rows under the same perturbations (paired)."""
    if len(copies) == 1:
        return copies[0]
    rows = copies[0].size
    kind = torch.arange(rows) % len(copies)

    def pick(values: list[Any]) -> Any:
        first = values[0]
        if not (isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == rows):
            return first
        stacked = torch.stack(values)  # [kinds, B, ...]
        return stacked[kind.to(first.device), torch.arange(rows, device=first.device)]

    args = tuple(pick([c.args[i] for c in copies]) for i in range(len(copies[0].args)))
    kwargs = {k: pick([c.kwargs[k] for c in copies]) for k in copies[0].kwargs}
    return Batch(args, kwargs, copies[0].labels)


@torch.no_grad()
def candidate_nll(bnn: BayesianModel, batches: Batches, ctx: DistContext,
                  shift: ShiftSignal | None, shift_batches: Batches | None, *,
                  clean: bool = True, samples_per_component: int | None = None,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-example NLL ``[T, n]`` on the clean split (``clean=False``: None, not computed)
    and ``[T, m]`` on its shifted copies (or the shift loader), of ``bnn``'s predictor
    (its default samples per component, or ``samples_per_component``) at temperature 1
    scaled by every T, each with the per-example error as a last row (``[T + 1, ·]``,
    :func:`_split`)."""
    predictor = bnn.predictor(samples_per_component, temperature=1.0)
    (scores, shifted), = grid_nll(
        lambda x: [predictor.predict(x).raw_log_probs], batches, ctx, shift, shift_batches,
        clean=clean)
    return scores, shifted


def grid_nll(log_probs_of: Callable[[Any], list[torch.Tensor]], batches: Batches,
             ctx: DistContext, shift: ShiftSignal | None, shift_batches: Batches | None,
             *, clean: bool = True) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """:func:`candidate_nll` for V candidates scored from one pass: ``log_probs_of(inputs)``
    returns every candidate's ``[B, C]`` log p̄ (T = 1) of one batch; per candidate the
    clean (None with ``clean=False``) and shifted ``[T + 1, ·]`` scores."""
    def nll_of(batch: Batch) -> list[torch.Tensor]:
        labels = batch.require_labels("the validation search")
        return [_nll_by_temperature(lambda t, lp=lp: temper(lp, t), labels.to(lp.device))
                for lp in log_probs_of(batch.model_input())]

    scores: list[list[torch.Tensor]] = []
    shifted: list[list[torch.Tensor]] = []
    copies = shift is not None and shift_batches is None and bool(shift.levels)
    if clean or copies:
        for index, batch in enumerate(batches()):
            if clean:
                scores.append(nll_of(batch))
            if copies:
                shifted.append(nll_of(interleaved(shift.copies(batch, index))))
    if shift_batches is not None:
        shifted = [nll_of(batch) for batch in shift_batches()]
    first = scores or shifted
    values = len(first[0]) if first else 1
    out = []
    for v in range(values):
        c = _gather([parts[v] for parts in scores], ctx) if clean else None
        s = (_gather([parts[v] for parts in shifted], ctx) if shifted or shift_batches
             else None)
        out.append((c, s))
    return out


@torch.no_grad()
def starting_point(bnn: BayesianModel, batches: Batches, ctx: DistContext, *,
                   signal: bool, whole_split: Batches | None = None,
                   ) -> tuple[torch.Tensor, int, list[int], torch.Tensor, float,
                              ShiftSignal | None]:
    """The starting network's per-example clean NLL at its best temperature ``[n]`` (from
    its own :func:`network_floor` up, for every family), that temperature's index, the indices
    of the temperatures the search may give ``bnn``, the start's per-example error ``[n]``,
    its :func:`network_floor` and the shift signal calibrated on the start (``signal``).

    The signal's strengths are calibrated by the main process on ``whole_split`` (the
    split as one process streams it: the same examples and batches on any number of ranks;
    without it, the main process's shard) and broadcast; each rank's copies are drawn from
    its batches' positions in the split (``ShiftSignal.first_index``)."""
    base = bnn.unwrap().eval()

    def logits(batch: Batch) -> torch.Tensor:
        return logits_of(call_model(base, batch.model_input())).float()

    parts, runner = _start_scores(logits, batches)
    per_t, errors = _split(_gather(parts, ctx))
    floor = network_floor(per_t, unseen_error(errors, _gather(runner, ctx)))
    columns = _at_least(temperature_floor(bnn, floor))
    # the reference: start + temperature scaling over the network's own range, for every
    # family (a sharpening family may go lower, but it is measured against the start as
    # honestly calibrated: on the CNN protocol's seed 2 the start "gained" 0.018 nats at
    # T = 0.6 on validation, 2.6 SE, and lost 0.011 on test)
    own = _at_least(floor)
    best = own[int(per_t[own].mean(1).argmin())]
    shift = None
    if signal:
        source = whole_split or batches
        local = calibrate_shift(logits, source) if ctx.is_main or not ctx.distributed else None
        shift = broadcast_object(local, ctx) if ctx.distributed else local
        if ctx.distributed:  # the batches of the ranks before this one
            counts = all_gather_objects(len(parts), ctx)
            shift = dataclasses.replace(shift, first_index=sum(counts[:ctx.rank]))
    return per_t[best], best, columns, errors, floor, shift


def _start_scores(logits: Callable[[Batch], torch.Tensor],
                  batches: Batches) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's ``[T + 1, B]`` pieces of the start's :func:`_base_nll` and
    :func:`_runner_up_nll`, one batch at a time (a function of its own: no batch outlives
    the pass, so the shift ladder's pass after it holds one batch at a time too)."""
    parts, runner = [], []
    for batch in batches():
        z = logits(batch)
        parts.append(_base_nll(z, batch))
        runner.append(_runner_up_nll(z))
    return parts, runner


def _runner_up_nll(logits: torch.Tensor) -> torch.Tensor:
    """``[T + 1, B]``: every example's NLL at every temperature were its label the runner-up
    class (the logits' second largest), then its margin (largest − second largest); a
    one-class output: NLL 0 and margin 0 (:func:`unseen_error`)."""
    if logits.shape[-1] < 2:
        return torch.zeros((len(TEMPERATURES) + 1, logits.shape[0]), dtype=torch.float64)
    top = logits.topk(2, dim=-1)
    rows = [per_example_nll(F.log_softmax(logits / t, dim=-1), top.indices[..., 1])
            for t in TEMPERATURES]
    rows.append(top.values[..., 0] - top.values[..., 1])
    return torch.stack(rows).double().cpu()


def _base_nll(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[T, B]`` per-example NLL of plain logits at every temperature."""
    labels = batch.require_labels("the validation search").to(logits.device)
    return _nll_by_temperature(lambda t: F.log_softmax(logits / t, dim=-1), labels)


@torch.no_grad()
def installed_scores(bnn: BayesianModel, batches: Batches,
                     ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n]`` per-example clean validation NLL and error (1 where the argmax is wrong) of
    ``bnn``'s predictive as it is now (its installed temperature), every rank's shard in
    rank order."""
    was_training = bnn.training
    bnn.eval()
    try:
        predictor = bnn.predictor()
        (clean, _), = grid_nll(lambda x: [predictor.predict(x).scaled(predictor.temperature)
                                          .log_probs], batches, ctx, None, None)
    finally:
        bnn.train(was_training)
    nll, errors = _split(clean)
    return nll[TEMPERATURES.index(1.0)], errors


def search_knobs(bnn: BayesianModel, knobs: list[Knob], batches: Batches, ctx: DistContext, *,
                 shift_batches: Batches | None = None, temperature: bool = True,
                 progress: bool = False,
                 keep: tuple[torch.Tensor, torch.Tensor] | None = None,
                 start: dict[str, Any] | None = None,
                 whole_split: Batches | None = None,
                 scores: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Choose every knob in turn, each jointly with the temperature (see the module
    docstring); installs the choice and returns the record.

    ``start["heads_follow"]``: the member-wise Laplace heads are part of the predictive
    after this search (fitted and searched next, or searched here too: set by
    :func:`search_with_heads` and :func:`tune`): a family knob at the narrow end of its grid
    is then logged, not warned about (:func:`_warn_at_edge`).

    ``keep``: the per-example clean validation NLL and error ``[n]`` of a predictive the
    search must not give back (:func:`installed_scores` of the family, searched, before its
    Laplace heads): where its mean NLL is below the calibrated start's, it is the
    feasibility reference instead, and no candidate may have more validation errors than
    both the family and the start — the heads add spread off the data; they do not spend the
    clean NLL the family gained (on the stress matrix's under-confident networks the families
    end 0.03–0.08 nats below the start, and heads searched against the start gave part of it
    back for shift NLL) nor add errors on the data (searched against the start's accuracy − 1
    point, the heads cost mean-field 1.2 points of test accuracy on the ViT protocol's seed
    1). A decision the family won over the start they may give back: capped at the family's
    own errors, one flipped example of 217 made every broad head of rank1 inadmissible on the
    CNN protocol's seed 1 (family 10 errors, start and heads 11, heads 0.010 nats *below* the
    start on clean validation NLL), and the predictive kept τ = 10⁴: 0.965 × the start's
    shift NLL where Laplace reaches 0.750 (benchmarks/results/session18.md).

    ``start``: a dict shared by consecutive searches of one model state and split (the
    family's, then its heads'): the first fills it with :func:`starting_point`'s result, the
    next reuse it instead of another pass of the start over the split and its shift ladder.
    Each search also leaves there, as ``"installed"``, the per-example clean NLL ``[n]`` and
    error ``[n]`` of its choice at the grid temperature (``temperature_on_grid``) — what
    :func:`installed_scores` would measure with that temperature installed, from the pass the
    walk already made (members are seeded: the same networks) — or None where the knob's
    ``settle`` may change the predictive after the walk (SWAG's BatchNorm statistics).

    ``whole_split``: the validation split as one process streams it, unsharded (the shift
    ladder's calibration on the main process: :func:`starting_point`).

    ``scores``: a dict that receives the choice's per-example shifted validation NLL ``[m]``
    (``"shift"``, every rank's shard in rank order) where the search scored it: what
    :meth:`bayesify.train.best.BestState._start_with_heads` pairs two searched states on."""
    if not knobs and not temperature:
        return {}
    heads_follow = bool(start is not None and start.get("heads_follow"))
    record: dict[str, Any] = {}
    was_training = bnn.training
    bnn.eval()
    try:
        point = start.get("point") if start is not None else None
        if point is None:
            point = starting_point(bnn, batches, ctx, signal=shift_batches is None,
                                   whole_split=whole_split)
            if start is not None:
                start["point"] = point
        reference, start_t, allowed, start_errors, floor, shift = point
        start_reference = float(reference.mean())
        error_cap = float(start_errors.mean()) + ACCURACY_TOLERANCE
        if keep is not None:
            kept_nll, kept_errors = keep
            record["family_val_nll"] = float(kept_nll.mean())
            if float(kept_nll.mean()) < start_reference:
                reference = kept_nll.to(reference)
            error_cap = min(error_cap, max(float(kept_errors.mean()),
                                           float(start_errors.mean())))
        favourable = favourable_examples(len(reference), float(start_errors.float().mean()))
        # every rank decides alike (a rank whose shard is empty sees no batch)
        tokens = temperature and any(all_gather_objects(token_inputs(batches), ctx))
        if tokens:
            record["sharpening"] = "off: token inputs"
            logger.info("%s: token inputs: the search does not sharpen the predictive below "
                        "the starting network's temperature floor (under wording shifts a "
                        "broad posterior sharpened back to the start's clean NLL was 1.1-1.6x "
                        "the start's NLL on a fine-tuned MiniLM)", bnn.method_name)
        record.update({"start_tempered_val_nll": start_reference,
                       "start_temperature": TEMPERATURES[start_t],
                       "temperature_floor": floor if tokens else TEMPERATURES[allowed[0]],
                       "favourable_examples": favourable,
                       "shift": "shift_loader" if shift_batches is not None
                       else (shift.describe() if shift is not None else {})})
        plan = knobs or [None]
        bar = progress_bar(None, f"{bnn.method_name} validation search",
                           enabled=progress and ctx.is_main,
                           total=sum(len(k.grid) if k is not None else 1 for k in plan))
        for knob in plan:
            values = [float(v) for v in knob.grid] if knob is not None else [math.nan]
            # the temperatures considered: from the floor up (temperature_floor; the whole
            # grid for a knob that spans a GLM spread, Knob.sharpens; the network's own floor
            # for token inputs); only 1 without the temperature search
            sharpens = not tokens and (sharpening_allowed(bnn)
                                       or (knob is not None and knob.sharpens))
            columns = ((_at_least(TEMPERATURES[0]) if sharpens
                        else _at_least(floor) if tokens else allowed) if temperature
                       else [TEMPERATURES.index(1.0)])
            below = [TEMPERATURES[c] < floor for c in columns]
            walk = _KnobWalk(bnn, knob, values, batches, ctx, shift, shift_batches,
                             reference=reference, error_cap=error_cap, columns=columns,
                             below=below, bar=bar, favourable=favourable)
            v, t = walk.run()
            clean, shifted = walk.clean, walk.shifted
            chosen_t = TEMPERATURES[columns[t]]
            record["temperature_on_grid"] = chosen_t  # every search's: the heads' after the family's
            if temperature and REFINE and walk.chosen_feasibly(v, t):
                chosen_t = refined_temperature(clean[v], columns, t, floor=floor)
            heads_knob = knob is not None and knob.name == laplace_heads.KNOB_NAME
            if start is not None and not heads_knob:  # the family's search: its spread
                start.setdefault("family_flat", []).append(_no_spread(knob, values[v]))
            if knob is not None:
                knob.set(values[v])
                curves = _curves(knob, values, v, columns[t], clean, shifted)
                record.update(curves)
                _warn_at_edge(bnn, knob, values, v,
                              shift_nll=curves.get(f"{knob.name}_shift_nll"),
                              heads_follow=heads_follow and not heads_knob,
                              family_spread=(not any(start["family_flat"]) if heads_knob
                                             and start is not None and "family_flat" in start
                                             else None))
                logger.info("%s: %s = %.3g, temperature %.3g chosen on validation (%s)",
                            bnn.method_name, knob.name, values[v], chosen_t, knob.meaning)
                if knob.settle is not None:
                    record.update(knob.settle())
            else:
                logger.info("%s: temperature %.3g chosen on validation", bnn.method_name,
                            chosen_t)
            record["temperature"] = chosen_t
            record["val_nll"] = float(clean[v][columns[t]].mean())
            if start is not None:  # what installed_scores would measure again (one pass)
                start["installed"] = ((clean[v][columns[t]], walk.errors[v])
                                      if knob is None or knob.settle is None else None)
            if shifted[v] is not None:
                record["val_shift_nll"] = float(shifted[v][columns[t]].mean())
                if scores is not None:
                    scores["shift"] = shifted[v][columns[t]]
        bar.close()
        bnn.state.set("temperature", record["temperature"])
        bnn.temperature_source = "search" if temperature else "default"
        if temperature and record["temperature"] == TEMPERATURES[-1]:
            logger.info("%s: temperature %.3g is the top of its search range", bnn.method_name,
                        record["temperature"])
    finally:
        bnn.train(was_training)
    return record


class _KnobWalk:
    """The scores of one knob's values and the choice among them (:func:`search_knobs`):
    a knob with ``grid_log_probs`` scores every value from one pass; any other scores them
    one pass each, coarse to fine — every other value (:func:`_first_values`), then the
    unscored grid neighbours (:func:`_neighbours`) of the current choice and of the broadest
    feasible value (:meth:`edge`) until they have none. Where the shifted NLL of the
    feasible values has one valley along the grid, or its lowest at the feasibility edge,
    that is the exhaustive search's choice."""

    def __init__(self, bnn: BayesianModel, knob: Knob | None, values: list[float],
                 batches: Batches, ctx: DistContext, shift: ShiftSignal | None,
                 shift_batches: Batches | None, *, reference: torch.Tensor, error_cap: float,
                 columns: list[int], below: list[bool], bar: Any,
                 favourable: int = 0) -> None:
        self.bnn, self.knob, self.values, self.bar = bnn, knob, values, bar
        self.favourable = favourable
        self.batches, self.ctx, self.shift, self.shift_batches = batches, ctx, shift, shift_batches
        self.reference, self.error_cap = reference, error_cap
        self.columns, self.below = columns, below
        #: per value index: clean ``[T, n]``, errors ``[n]``, shifted ``[T, m]`` or None
        self.clean: dict[int, torch.Tensor] = {}
        self.errors: dict[int, torch.Tensor] = {}
        self.shifted: dict[int, torch.Tensor | None] = {}
        #: per value index scored one by one: whether some temperature makes it feasible
        self.feasible: dict[int, bool] = {}
        self.wants_shift = shift_batches is not None or (shift is not None and bool(shift.levels))

    def run(self) -> tuple[int, int]:
        """(value index, temperature position in ``columns``); the knob is left at the
        last value scored."""
        knob, values = self.knob, self.values
        if knob is not None and knob.grid_log_probs is not None:  # one pass, every value
            for i, (c, s) in enumerate(grid_nll(knob.grid_log_probs, self.batches, self.ctx,
                                                self.shift, self.shift_batches)):
                self.clean[i], self.errors[i] = _split(c)
                self.shifted[i] = None if s is None else _split(s)[0]
            self.bar.update(len(values))
            v, t = self.choose()
        else:
            for i in _first_values(values, walk=knob is None or knob.walk):
                self.score(i)
            while True:
                v, t = self.choose()
                more = [i for i in {*_neighbours(values, v), *_neighbours(values, self.edge())}
                        if i not in self.clean]
                if not more:
                    break
                for i in more:
                    self.score(i)
            self.bar.update(len(values) - len(self.clean))
        if self.wants_shift and self.shifted[v] is None:
            # the chosen value's shifted pass was skipped (nothing was feasible, or rule
            # 'min'): scored now, for the record
            if knob is not None:
                knob.set(values[v])
            self.shifted[v] = self.shifted_nll(v)
        return v, t

    def shifted_nll(self, i: int) -> torch.Tensor:
        """``[T, m]`` of value ``i`` (the knob's current value) on the shifted split alone."""
        return _split(candidate_nll(self.bnn, self.batches, self.ctx, self.shift,
                                    self.shift_batches, clean=False,
                                    samples_per_component=self.samples(i))[1])[0]

    def samples(self, i: int) -> int | None:
        """Samples per component to predict value ``i`` with: 1 where every sample of a
        component is the same network (``Knob.one_sample_at``: a spread multiplier at 0, scored
        at 1/S of the passes), else the predictor's default (None)."""
        knob = self.knob
        if knob is not None and knob.one_sample_at is not None \
                and self.values[i] == knob.one_sample_at:
            return 1
        return None

    def score(self, i: int) -> None:
        """Value ``i``'s clean scores; its shifted ones only if some temperature makes it
        feasible on the clean split: the choice reads the shifted NLL of feasible values
        alone (choose_joint), so the others' cost a pass each for nothing (MNF on the CNN
        protocol: 4 of its 8 noise scales)."""
        knob, columns = self.knob, self.columns
        if knob is not None:
            knob.set(self.values[i])
        c, e = _split(candidate_nll(self.bnn, self.batches, self.ctx, None, None,
                                    samples_per_component=self.samples(i))[0])
        self.clean[i], self.errors[i], self.shifted[i] = c, e, None
        self.feasible[i] = self.could_be_chosen(c[columns], e)
        if self.wants_shift and (knob is None or knob.rule != "min") and self.feasible[i]:
            self.shifted[i] = self.shifted_nll(i)
        self.bar.update(1)

    def feasible_columns(self, clean: torch.Tensor, errors: torch.Tensor) -> torch.Tensor:
        """``[T]``: which temperatures make a value with clean scores ``[T, n]`` (at
        ``columns``) and errors ``[n]`` feasible and admissible."""
        return (feasible(clean[None], self.reference, favourable=self.favourable)
                & _admissible(clean[None], errors[None], error_cap=self.error_cap,
                              reference=self.reference, below=self.below,
                              favourable=self.favourable))[0]

    def could_be_chosen(self, clean: torch.Tensor, errors: torch.Tensor) -> bool:
        """Whether some temperature makes the value feasible and admissible."""
        return bool(self.feasible_columns(clean, errors).any())

    def chosen_feasibly(self, v: int, t: int) -> bool:
        """Whether value ``v`` at position ``t`` of ``columns`` is feasible and admissible (a
        choice by the search's rule, not its fallback to the lowest clean NLL), or the knob's
        rule is the plain clean minimum (``'min'``)."""
        if self.knob is not None and self.knob.rule == "min":
            return True
        return bool(self.feasible_columns(self.clean[v][self.columns], self.errors[v])[t])

    def edge(self) -> int:
        """The broadest scored value (``knob.prefer``) that some temperature makes feasible
        (the narrowest scored value when none is): the shifted NLL of a spread knob often
        falls until feasibility stops it, after a flat stretch where the valley search alone
        stops early (SWAG's scale on the CNN protocol, seed 2: 1.95, 1.96, 1.96, 1.97, 1.95,
        1.93, then infeasible)."""
        done = sorted(self.clean, key=lambda i: self.values[i])
        largest = self.knob is None or self.knob.prefer == "largest"
        feasible_values = [i for i in done if self.feasible[i]]
        if not feasible_values:
            return done[0] if largest else done[-1]
        return feasible_values[-1] if largest else feasible_values[0]

    def choose(self) -> tuple[int, int]:
        """(value index, temperature position in ``columns``) among the values scored."""
        done, knob = sorted(self.clean), self.knob
        clean_t = torch.stack([self.clean[i] for i in done])[:, self.columns]
        admissible = _admissible(clean_t, torch.stack([self.errors[i] for i in done]),
                                 error_cap=self.error_cap, reference=self.reference,
                                 below=self.below, favourable=self.favourable)
        shifted_t = _stacked([self.shifted[i] for i in done], self.columns)
        if knob is not None and knob.rule == "min":  # the lowest clean NLL, nothing else
            flat = int(clean_t.mean(-1).argmin())
            return done[flat // clean_t.shape[1]], flat % clean_t.shape[1]
        v, t = choose_joint(clean_t, shifted_t, self.reference,
                            prefer=knob.prefer if knob is not None else "largest",
                            grid=[self.values[i] for i in done] if knob is not None else None,
                            admissible=admissible, favourable=self.favourable)
        return done[v], t


def refined_temperature(clean: torch.Tensor, columns: list[int], t: int, *,
                        floor: float) -> float:
    """The temperature at position ``t`` of ``columns`` (the indices of :data:`TEMPERATURES`
    the search could choose), refined (:data:`REFINE`) when it is the lowest mean of
    ``clean [T, n]`` (one knob value's per-example clean NLL at every temperature of the
    grid) among ``columns`` and no higher than at either grid neighbour: the vertex, in
    log T, of the parabola through the three points, within half a step of it. Never below
    ``floor`` from a temperature at or above it (a family does not sharpen by refinement;
    the neighbour below the floor is scored all the same, and gives the parabola's side)."""
    chosen, i = TEMPERATURES[columns[t]], columns[t]
    means = clean.mean(-1)
    if not 0 < i < len(TEMPERATURES) - 1 or int(means[columns].argmin()) != t:
        return chosen
    f = [float(means[j]) for j in (i - 1, i, i + 1)]
    if not f[1] <= min(f[0], f[2]) or not all(map(math.isfinite, f)):
        return chosen
    u = [math.log(TEMPERATURES[j]) for j in (i - 1, i, i + 1)]
    num = (u[1] - u[0]) ** 2 * (f[1] - f[2]) - (u[1] - u[2]) ** 2 * (f[1] - f[0])
    den = (u[1] - u[0]) * (f[1] - f[2]) - (u[1] - u[2]) * (f[1] - f[0])
    if not den:
        return chosen
    out = math.exp(min(max(u[1] - 0.5 * num / den, u[0]), u[2]))
    return max(out, floor) if chosen >= floor - 1e-12 else out


def _admissible(clean: torch.Tensor, errors: torch.Tensor, *, error_cap: float,
                reference: torch.Tensor, below: list[bool], favourable: int = 0) -> torch.Tensor:
    """``[V, T]`` of ``clean [V, T, n]`` and ``errors [V, n]``: the rules besides the clean
    NLL's. A value that loses more than ACCURACY_TOLERANCE of clean validation accuracy
    against the start (with keep: any against both the family and the start; ``error_cap``)
    is never feasible (a temperature does not move the argmax); a temperature below the
    network's floor (``below``) only where the value needs it
    (:func:`_sharpen_only_if_needed`)."""
    ok = (errors.mean(-1) <= error_cap + 1e-12).view(-1, 1).expand(len(clean), len(below))
    return _sharpen_only_if_needed(clean, reference, ok, below, favourable=favourable)


def _stacked(shifted: list[torch.Tensor | None], columns: list[int]) -> torch.Tensor | None:
    """``[V, T, m]`` of the scored values' shifted NLL at ``columns``, NaN rows for the values
    not scored (never feasible: :func:`choose_joint` does not read them); None when none was."""
    done = next((s for s in shifted if s is not None), None)
    if done is None:
        return None
    return torch.stack([torch.full_like(done, math.nan) if s is None else s
                        for s in shifted])[:, columns]


def _sharpen_only_if_needed(clean: torch.Tensor, reference: torch.Tensor,
                            admissible: torch.Tensor, below: list[bool], *,
                            favourable: int = 0) -> torch.Tensor:
    """``[V, T]``: a temperature below the network's own floor (:func:`network_floor`) only
    for knob values that no temperature at or above it makes feasible — sharpening brings a
    *broad* posterior back to the start's clean NLL; a value already feasible unsharpened
    would only be temperature-scaled like the network (on the CNN quality protocol's seed 2
    Laplace had sharpened to T = 0.7 and ended at 1.28× the start's shift NLL, 3.12 against
    2.43 unsharpened; with this rule and the reference over the network's own range: T = 0.84,
    0.98×)."""
    below_t = torch.tensor(below, dtype=torch.bool)
    if not below_t.any():
        return admissible
    ok = feasible(clean, reference, favourable=favourable) & admissible
    settled = ok[:, ~below_t].any(1)  # values feasible at T ≥ floor
    return admissible & ~(below_t.view(1, -1) & settled.view(-1, 1))


def _curves(knob: Knob, values: list[float], v: int, t: int, clean: dict[int, torch.Tensor],
            shifted: dict[int, torch.Tensor | None]) -> dict[str, Any]:
    """The record's curves of one knob at the chosen temperature (index ``t`` of
    :data:`TEMPERATURES`): None for a value the search did not score (clean: skipped by the
    coarse-to-fine walk; shifted: also where no temperature made the value feasible)."""
    out = {knob.name: values[v], f"{knob.name}_grid": values,
           f"{knob.name}_val_nll": [float(clean[i][t].mean()) if i in clean else None
                                    for i in range(len(values))]}
    if any(s is not None for s in shifted.values()):
        out[f"{knob.name}_shift_nll"] = [
            float(shifted[i][t].mean()) if shifted.get(i) is not None else None  # type: ignore[index]
            for i in range(len(values))]
    return out


def _first_values(values: list[float], *, walk: bool = True) -> list[int]:
    """The values a per-value search scores first, in value order: all of them for a knob
    that does not walk (``Knob.walk``) or a grid of at most :data:`FULL_GRID` values, else
    every other one, both ends included (``ceil(V / 2)`` evenly spaced positions: 0, 0.25, 1,
    2 of the spread grid)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    if not walk or len(values) <= FULL_GRID or not COARSE_TO_FINE:
        return order
    count = math.ceil(len(values) / 2)
    positions = sorted({round(k * (len(values) - 1) / (count - 1)) for k in range(count)})
    return [order[p] for p in positions]


def _neighbours(values: list[float], index: int) -> list[int]:
    """The indices of the values just below and just above ``values[index]``."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    at = order.index(index)
    return [order[p] for p in (at - 1, at + 1) if 0 <= p < len(order)]


#: at the broadest end of a grid, a shifted validation NLL within this fraction of the next
#: value's has flattened: a broader value would change little, and the choice is logged, not
#: warned about (the demo's iBNN heads at τ = 1e-4: 1.1426 against 1.1453 at 3.2e-4, 0.24 %,
#: after steps of 0.7 %, 1.7 % and 3.6 % — the curve had converged, yet the first screen a
#: user saw said the best value might lie beyond the grid)
FLAT_EDGE = 0.01


def _flat_at_edge(values: list[float], index: int,
                  shift_nll: list[float | None] | None) -> float | None:
    """The grid neighbour's shifted validation NLL where the one at ``values[index]`` (an end
    of the grid) is within :data:`FLAT_EDGE` of it (both scored at the chosen temperature),
    else None."""
    neighbour = _neighbours(values, index) if shift_nll else []
    if len(neighbour) != 1:
        return None
    edge, near = shift_nll[index], shift_nll[neighbour[0]]  # type: ignore[index]
    flat = (edge is not None and near is not None and math.isfinite(edge)
            and math.isfinite(near) and near - edge <= FLAT_EDGE * abs(edge))
    return near if flat else None


def _no_spread(knob: Knob | None, value: float) -> bool:
    """Whether a family's knob at ``value`` leaves each posterior component one network: at
    its ``one_sample_at`` (a spread multiplier's 0); for a knob without one and without an
    initial value (SWAG's scale), at the narrow end of its grid. A knob with an initial
    value (a member temperature's 1: the members as trained) keeps the members' spread."""
    if knob is None:
        return False
    if knob.one_sample_at is not None:
        return value == knob.one_sample_at
    if knob.initial is not None:
        return False
    return value == (min(knob.grid) if knob.prefer == "largest" else max(knob.grid))


def _warn_at_edge(bnn: BayesianModel, knob: Knob, values: list[float], index: int, *,
                  shift_nll: list[float | None] | None = None,
                  heads_follow: bool = False, family_spread: bool | None = None) -> None:
    """A value at an end of its grid says the grid, not the data, decided — except at the
    broad end of a shifted NLL that had flattened there (``shift_nll``: the per-value
    shifted validation NLL at the chosen temperature, None where unscored;
    :data:`FLAT_EDGE`), at the narrow end of a family's knob whose member-wise Laplace
    heads follow (``heads_follow``: they give the predictive its spread off the data, and
    "keeps only the spread training gave" is not true), and at the narrow end of the heads'
    own τ where the family's search kept a spread (``family_spread``: no family knob at a
    value where its samples are one network, :func:`_no_spread`; the heads added
    nothing the validation data rewarded, and the predictive is the family's own as its
    search chose it — on the stress matrix's token transformer five families were told to
    "train longer … or use another family" after fits within every bar), which are
    logged. Where the family's spread is off too (``family_spread=False``), the heads'
    narrow end is warned about, saying so: the predictive is the posterior's mean network's
    (``None``: not the heads' knob, or no family search before it)."""
    if len(values) < 2:
        return
    ordered = sorted(values)
    narrowest = ordered[0] if knob.prefer == "largest" else ordered[-1]
    broadest = ordered[-1] if knob.prefer == "largest" else ordered[0]
    value = values[index]
    flat_near = _flat_at_edge(values, index, shift_nll) if value == broadest else None
    if value == narrowest and heads_follow:
        logger.info("%s: the validation search chose %s = %g, the narrowest end of its grid; "
                    "the member-wise Laplace heads give the predictive its spread off the data",
                    bnn.method_name, knob.name, value)
    elif value == narrowest and family_spread:
        logger.info("%s: the validation search chose %s = %g, the narrowest end of its grid "
                    "(%s): no broader head did better on validation; the predictive is the "
                    "family's own, with the spread its search chose", bnn.method_name,
                    knob.name, value, knob.meaning)
    elif value == narrowest:
        advice = "give fit a shift_loader that shows the shift you expect, or use another family"
        advice = (advice.capitalize() if bnn.method.step().trains_nothing
                  else f"Train longer (more epochs), {advice}")
        keeps = ("and the family's own search chose no spread either: the predictive is the "
                 "posterior's mean network, tempered" if family_spread is False
                 else "so the predictive keeps only the spread training gave the posterior")
        warnings.warn(
            f"{bnn.method_name}: the validation search chose {knob.name} = {value:g}, the "
            f"narrowest end of its grid ({knob.meaning}): no broader value did as well on "
            f"validation (clean NLL within {CLEAN_TOLERANCE:g} nats of the calibrated start's, "
            f"then the lowest NLL under the search's shifts), {keeps}. {advice}", stacklevel=3)
    elif flat_near is not None:
        logger.info("%s: the validation search chose %s = %g, the broadest end of its grid; "
                    "the NLL under the search's shifts had flattened there (%.4g against %.4g "
                    "at the next value): a broader value would change little",
                    bnn.method_name, knob.name, value, shift_nll[index],  # type: ignore[index]
                    flat_near)
    elif value == broadest and not (knob.broad_limit is not None and knob.broad_limit()):
        warnings.warn(
            f"{bnn.method_name}: the validation search chose {knob.name} = {value:g}, the "
            f"broadest end of its grid ({knob.meaning}): the best value may lie beyond it; "
            f"{knob.widen or _widen_advice(bnn)}", stacklevel=3)


def _widen_advice(bnn: BayesianModel) -> str:
    """What widens the search: the family's grid option where it has one (``*_grid``), else
    the posterior itself (the grid of a spread or temperature knob is fixed)."""
    import dataclasses

    config = bnn.method.config
    options = [f.name for f in dataclasses.fields(config) if f.name.endswith("grid")]
    if options:
        return " or ".join(f"widen {name!r} (now {getattr(config, name)!r})" for name in options)
    priors = [f.name for f in dataclasses.fields(config) if f.name.startswith("prior_std")]
    if priors:
        return (f"{bnn.method_name} has no grid option (its grid is fixed): the trained "
                "posterior is narrower than the validation data asks for; a broader prior ("
                + ", ".join(f"{name}={getattr(config, name)!r} now" for name in priors)
                + f") or more training widens it (see `bayesify methods {bnn.method_name}`)")
    return (f"{bnn.method_name} has no grid option (its grid is fixed): the members are more "
            "confident than the validation data supports; predictor.calibrate(val_loader) "
            "fits a temperature afterwards")


class _HeadsPass:
    """What :func:`bayesify.kit.laplace_heads.fit_heads` reads of a ``FitContext``, over a
    user's training loader (for :func:`tune` after another training loop)."""

    def __init__(self, bnn: BayesianModel, loader: Iterable, ctx: DistContext,
                 batch_fn: BatchFn | None) -> None:
        self.bnn, self._loader, self._ctx, self._batch_fn = bnn, loader, ctx, batch_fn

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    def batches(self, fraction: float = 1.0) -> Iterator[Batch]:
        return shard_batches(self._loader, self._ctx, device=self.bnn.device,
                             batch_fn=self._batch_fn, fraction=fraction)

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(values, self._ctx)

    def all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_mean(values, self._ctx)


def search_with_heads(bnn: BayesianModel, search: Callable[..., dict[str, Any]],
                      scores: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                      heads_source: Any, *, knobs: list[Knob] | None = None) -> dict[str, Any]:
    """The validation search of the model's current state, in ``fit`` and :func:`tune`: the
    family's knobs (with the temperature); then, with ``laplace_heads``, the heads fitted on
    the members as searched (a knob such as iBNN's noise scale changes their features) over
    ``heads_source``'s training batches and their τ with the temperature, kept to what the
    family reached (``scores``: :func:`installed_scores`). ``search(knobs, keep=, start=)``
    runs :func:`search_knobs` on the split; both searches share the start's pass.
    ``knobs``: the family's knobs to search (default: all it declares; :func:`neutral_knobs`
    for the starting state with heads)."""
    laplace_heads.unfit(bnn)  # heads of an earlier state (keep-best) are stale
    # the searches read it there: a family knob at the narrow end of its grid is the heads'
    start: dict[str, Any] = {"heads_follow": laplace_heads.enabled(bnn)}
    record = search(bnn.method.knobs(bnn) if knobs is None else knobs, start=start)
    if laplace_heads.enabled(bnn):  # member-wise Laplace heads (issue 31)
        # what the family reached, at its grid temperature (the start's reference is on the
        # grid: a refined family below it by the refinement alone became the heads'
        # reference, and on the stress matrix's token transformer, seed 1, the heads then
        # chose T = 2 over 2.38 and three families ended 0.02 nats worse on test)
        own = start.pop("installed", None)  # the walk's pass of the choice, where it has one
        if own is None:
            refined = bnn.state.value("temperature")
            bnn.state.set("temperature", record.get("temperature_on_grid", refined))
            try:
                own = scores()  # the heads keep it
            finally:
                bnn.state.set("temperature", refined)
        record.update(laplace_heads.fit_heads(heads_source))
        record.update(search(laplace_heads.heads_knob(bnn), keep=own, start=start))
    return record


def neutral_knobs(knobs: list[Knob]) -> list[Knob]:
    """Each knob with its grid reduced to its neutral value — where every member of a
    starting state is the network itself: a spread multiplier's 0 (``one_sample_at``, scored
    with one sample per component), a member temperature's initial 1 (the members of a
    starting ensemble are copies), else its narrowest grid value (SWAG's start has no
    spread: any scale is the network)."""
    out = []
    for knob in knobs:
        if knob.one_sample_at is not None:
            value = knob.one_sample_at
        elif knob.initial is not None:
            value = knob.initial
        else:
            value = min(knob.grid) if knob.prefer == "largest" else max(knob.grid)
        out.append(dataclasses.replace(knob, grid=(float(value),)))
    return out


@contextlib.contextmanager
def one_sample_per_component(bnn: BayesianModel, knobs: list[Knob]) -> Iterator[None]:
    """Inside: the family predicts with one sample per component (``predict_samples=1``)
    where every knob is fixed at its ``one_sample_at`` value — every sample of a component
    is then the same network, so the predictive, the heads' curvature (averaged over a
    component's samples) and their search are those of the default S samples at 1/S of the
    member forwards (iBNN: 4 of 8). Nothing changes otherwise."""
    config = bnn.method.config
    fixed = bool(knobs) and all(k.one_sample_at is not None and k.grid == (k.one_sample_at,)
                                for k in knobs)
    if not fixed or not hasattr(config, "predict_samples") or config.default_samples() == 1:
        yield
        return
    bnn.method.config = dataclasses.replace(config, predict_samples=1)
    try:
        yield
    finally:
        bnn.method.config = config


def tune(bnn: BayesianModel, val_loader: Iterable, *, train_loader: Iterable | None = None,
         batch_fn: BatchFn | None = None, shift_loader: Iterable | None = None,
         temperature: bool = True, progress: bool = True,
         start: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Choose the family's declared knobs (``bnn.method.knobs(bnn)``) and the temperature on
    ``val_loader`` (see the module docstring).

    What ``fit(val_loader=...)`` does after its last epoch, for a model trained by another
    loop (``elbo_loss`` in a custom loop, the Hugging Face ``Trainer``). ``train_loader``:
    where the family has member-wise Laplace heads (``laplace_heads``), they are fitted on
    its first 10,000 examples after the family's search and their τ searched as ``fit``
    does (without it the heads stay as they are, unfitted: the family's own predictive).
    ``shift_loader``: labelled inputs under the shift you expect (replaces the library's
    perturbations as the robustness signal); ``temperature=False`` keeps the temperature at
    1. Under ``torchrun`` (a process group already initialised) every rank streams its shard
    and all ranks choose the same values. Returns the record.

    ``start``: the state training began from (:func:`bayesify.train.best.starting_state`,
    taken before the custom loop's first step; ``BayesTrainer`` takes it). With heads and a
    ``train_loader``, the trained state is then weighed against that start with its knobs
    neutral and its own heads, as ``fit`` does
    (:func:`~bayesify.train.best.start_with_heads`): the start is handed back when it is
    feasible and lower under the validation shift by more than one paired standard error,
    or when the trained state is not feasible (the record then says ``kept: "start"``;
    ``start_heads_*`` keep what was compared either way).
    """
    if val_loader is None:
        raise BayesifyError("tune needs a validation loader (batches with labels)")
    if not bnn.method.step().ready(bnn):
        raise BayesifyError(
            f"method {bnn.method_name!r} builds its posterior inside bayesify.fit (it has none "
            "yet), so a custom training loop cannot produce it: use bayesify.fit(bnn, "
            "train_loader, val_loader=val_loader), which also runs this search")
    ctx = current_context(bnn.device)

    def batches() -> Iterator[Batch]:
        return shard_batches(val_loader, ctx, device=bnn.device, batch_fn=batch_fn)

    def shifted() -> Iterator[Batch]:
        return shard_batches(shift_loader, ctx, device=bnn.device, batch_fn=batch_fn)

    def whole() -> Iterator[Batch]:
        return whole_batches(val_loader, device=bnn.device, batch_fn=batch_fn)

    def search(knobs: list[Knob], **kwargs: Any) -> dict[str, Any]:
        return search_knobs(bnn, knobs, batches, ctx,
                            shift_batches=shifted if shift_loader is not None else None,
                            temperature=temperature, progress=progress,
                            whole_split=whole, **kwargs)

    if laplace_heads.enabled(bnn) and train_loader is not None:
        # the heads' classifier gives the logits? (turned off, warned, where not: before any pass)
        first = next(iter(whole()), None)
        if first is not None:
            laplace_heads.settle_on(bnn, first)
    heads = laplace_heads.enabled(bnn)
    with naming_unresponsive_ranks(ctx), rank_zero_warnings(ctx):  # only rank 0 warns
        if heads and train_loader is not None:  # as fit's search does
            scores: dict[str, torch.Tensor] = {}
            heads_pass = _HeadsPass(bnn, train_loader, ctx, batch_fn)

            def searched(knobs: list[Knob] | None = None) -> dict[str, Any]:
                return search_with_heads(bnn, functools.partial(search, scores=scores),
                                         lambda: installed_scores(bnn, batches, ctx),
                                         heads_pass, knobs=knobs)

            record = searched()
            if start is None:
                return record
            return _weigh_start(bnn, record, start, searched, scores, ctx)
        if heads and not laplace_heads.fitted(bnn):
            logger.info("%s: laplace_heads are not fitted: tune(bnn, val_loader, "
                        "train_loader=...) fits them (a pass over up to 10,000 training "
                        "examples after the family's search); without it the family's own "
                        "knobs are searched", bnn.method_name)
        own_heads = laplace_heads.heads_knob(bnn)  # fitted heads are searched alongside
        return search(bnn.method.knobs(bnn) + own_heads, start={"heads_follow": bool(own_heads)})


def _weigh_start(bnn: BayesianModel, record: dict[str, Any], start: dict[str, torch.Tensor],
                 searched: Callable[..., dict[str, Any]], scores: dict[str, torch.Tensor],
                 ctx: DistContext) -> dict[str, Any]:
    """:func:`tune`'s weighing of the trained state (``record``) against ``start`` with its
    heads (:func:`~bayesify.train.best.start_with_heads`): the record ``tune`` returns."""
    def neutral() -> dict[str, Any]:
        knobs = neutral_knobs(bnn.method.knobs(bnn))
        with one_sample_per_component(bnn, knobs):
            return searched(knobs)

    chosen = start_with_heads(bnn, record, start, neutral, scores.get("shift"), scores,
                              is_main=ctx.is_main, if_infeasible=True, caller="tune")
    if chosen is None:
        return {**record, "kept": "last"}
    compared = {k: v for k, v in record.items() if k.startswith("start_heads_")}
    return {**chosen, **compared, "kept": "start", "trained_val_nll": record.get("val_nll"),
            "trained_val_shift_nll": record.get("val_shift_nll")}
