"""The spread guard of a gradient fit without validation data.

With a ``val_loader`` the knob search chooses how much of the learned spread the
predictive uses (:mod:`bayesify.train.tuning`). Without one the trained spread (knob 1)
was kept as it came out of training, and on the held-out stress matrix that cost accuracy:
the hypernetwork's noise −2.75 and −2.2 points on two BatchNorm CNNs (seed 2), where it cost
2 points of training accuracy too (benchmarks/results/session5.md). This guard runs once, at
the end of such a fit: on the first :data:`GUARD_ROWS` training examples (over the
processes) it keeps the largest multiplier of 1, ½, ¼ and 0.1 (else 0, the posterior mean)
whose predictive keeps the accuracy of the mean network (the knob at 0) within
``tolerance`` (one point), counts summed over the ranks
(:func:`bayesify.kit.steps.keeps_accuracy`), so every rank makes the same choice. Candidates are predicted lazily: a fit whose spread keeps the accuracy pays two
passes over those rows (the mean network, then the predictive).

It applies to the knobs that multiply a learned spread, i.e. whose grid holds 0 (the mean
network) and that training leaves at 1; member temperatures and Laplace are left alone
(Laplace and post-hoc dropout have their own guards). Training accuracy cannot see every
loss — a network that fits its training set perfectly shows no flipped example at any
spread — so validation data remains the way to choose the spread.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from bayesify.kit import laplace_heads
from bayesify.kit.steps import count_correct, keeps_accuracy
from bayesify.train.data import epoch_batches, first_rows

if TYPE_CHECKING:
    from bayesify.core.fitting import Knob
    from bayesify.train.context import TrainContext

logger = logging.getLogger(__name__)

#: training examples the guard predicts (over the processes, each its share)
GUARD_ROWS = 1024
#: the multipliers tried, largest first (0, the mean network, when none keeps the accuracy)
GUARD_SCALES = (1.0, 0.5, 0.25, 0.1)
#: accuracy (a fraction) the spread may cost on those examples
TOLERANCE = 0.01


def spread_knobs(knobs: list[Knob]) -> list[Knob]:
    """The knobs that multiply a learned spread (0 in the grid, 1 after training)."""
    return [k for k in knobs if 0.0 in k.grid and k.initial == 1.0]


@torch.no_grad()
def guard_spread(state: TrainContext, knobs: list[Knob],
                 tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Choose each spread knob of a fit without validation (see the module); the record."""
    record: dict[str, Any] = {}
    guarded = spread_knobs(knobs)
    rows = _rows(state) if guarded else []  # read once for every knob
    for knob in guarded:
        record.update(_guard_one(state, knob, rows, tolerance))
    return record


def _rows(state: TrainContext) -> list[tuple[Any, torch.Tensor]]:
    """This process's share of the first :data:`GUARD_ROWS` training examples of the last
    epoch's order (whole batches, at least one): ``GUARD_ROWS / world size`` each, so that
    ``torchrun`` counts the examples one process would."""
    quota = math.ceil(GUARD_ROWS / max(state.ctx.world_size, 1))
    state.data.set_epoch(max(state.epoch, 0))
    return first_rows(epoch_batches(state.data, device=state.bnn.device,
                                    batch_fn=state.batch_fn), quota)


def _correct(bnn: Any, rows: list[tuple[Any, torch.Tensor]], samples: int | None) -> float:
    return count_correct(bnn, rows, lambda x: bnn.predictive(
        x, samples_per_component=samples, seed=0).probs, bnn.device)


def _guard_one(state: TrainContext, knob: Knob, rows: list[tuple[Any, torch.Tensor]],
               tolerance: float) -> dict[str, Any]:
    bnn = state.bnn
    was_training = bnn.training
    bnn.eval()
    n = float(sum(y.shape[0] for _, y in rows))
    chosen, mean_acc, spread_acc, total = None, 0.0, 0.0, 0
    try:
        knob.set(0.0)
        # the mean network: one member is all of it (fitted member-wise Laplace heads
        # predict with the family's member count; a fit without validation has none)
        mean_correct = _correct(bnn, rows, None if laplace_heads.fitted(bnn) else 1)
        for scale in GUARD_SCALES:
            knob.set(scale)
            # the mean network's and this candidate's correct counts, summed over the ranks
            counts = torch.tensor([mean_correct, _correct(bnn, rows, None), n],
                                  dtype=torch.float64, device=bnn.device)
            guard = keeps_accuracy(state, counts, tolerance)
            if guard is None:  # no examples on any rank: the trained spread stays
                knob.set(1.0)
                return {}
            ok, (mean_acc, acc), total = guard
            if scale == 1.0:
                spread_acc = acc
            if ok is not None:
                chosen = scale
                break
    finally:
        bnn.train(was_training)
    value = 0.0 if chosen is None else chosen
    knob.set(value)
    if value != 1.0 and state.is_main:
        logger.info(
            "%s: no val_loader to choose the spread on; %s set to %g, the largest of %s "
            "whose predictive keeps the mean network's accuracy (%.4f) on %d training "
            "examples within %g (with the trained spread: %.4f; pass a val_loader to choose "
            "it on validation data)", bnn.method_name, knob.name, value, GUARD_SCALES,
            mean_acc, total, tolerance, spread_acc)
    return {knob.name: value, "guard_train_accuracy_mean": mean_acc,
            "guard_train_accuracy_spread": spread_acc}
