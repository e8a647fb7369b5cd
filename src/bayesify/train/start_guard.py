"""Never worse than the start without validation data: the training examples decide.

With a ``val_loader`` a fit hands back its last state only when it is not clearly worse
than the network it started from (:mod:`bayesify.train.best`). Without one nothing checked
that, and on the real EfficientNet-Lite0 (50 wrapped layers, a 10-way digit head, 300
training images) two families ended far below it: Bayes by Backprop at 0.75 test accuracy
and MNF at 0.72 against the network's 0.83, their mean networks at 0.44 training accuracy
after ten steps (the spread guard, :mod:`bayesify.train.spread_guard`, compares a spread with
the mean network, which had already moved). So a fresh gradient fit without validation
data predicts up to :data:`ROWS` training examples (over the processes, the first of each
process's contiguous shard) with the network it starts from (the posterior mean at the
start: the pretrained weights), before the first step, and with the posterior it ends with,
after the spread guard. Where the posterior's accuracy there is *clearly* lower —
by more than a point and by more than a few examples (:func:`dropped`, the rule of
:func:`bayesify.train.best.clearly_worse`) — the fit hands back the state it began with (the
network as a posterior; its spread guarded again) and warns. Counts are summed over the
ranks, so every rank decides alike. Training accuracy cannot see every loss (a network that
fits its training set shows none); validation data remains the way to judge a posterior.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from bayesify.core.batch import call_model
from bayesify.core.checks import explain_shapes
from bayesify.core.outputs import logits_of
from bayesify.kit.steps import count_correct
from bayesify.train.best import ACCURACY_MARGIN, FLIPPED_EXAMPLES, _snapshot

if TYPE_CHECKING:
    from bayesify.train.context import TrainContext

logger = logging.getLogger(__name__)

#: training examples (over the processes) the start and the end are compared on
ROWS = 512


def dropped(start: float, end: float, n: int) -> bool:
    """Whether accuracy ``end`` is clearly below ``start`` on ``n`` examples: by more than
    :data:`~bayesify.train.best.ACCURACY_MARGIN` and by more examples than two binomial
    standard deviations (at least :data:`~bayesify.train.best.FLIPPED_EXAMPLES`)."""
    drop = start - end
    noise = max(FLIPPED_EXAMPLES, 2 * math.sqrt(n * start * (1 - start)))
    return drop > ACCURACY_MARGIN + 1e-12 and drop * n > noise + 1e-6


class StartGuard:
    """The start's training accuracy before a fresh fit without validation, compared with
    the end's after it (see the module docstring)."""

    def __init__(self, state: TrainContext, *, fresh: bool) -> None:
        step, bnn = state.family, state.bnn
        trains = getattr(step, "trains_posterior", False)
        start_state = getattr(step, "start_state", None)
        self.state = state
        self.active = (fresh and state.val_loader is None and step.optimizes
                       and (trains or start_state is not None))
        self.initial: dict[str, torch.Tensor] | None = None
        self.start_state: Callable[[Any], dict[str, torch.Tensor]] | None = None
        if not self.active:
            return
        self.rows = state.labelled_rows(ROWS)
        network = getattr(step, "network_state", None)  # the start as the network itself
        if trains:  # held on the CPU for the whole fit (an ensemble's copies are its size)
            self.initial = _snapshot(bnn, device="cpu")
            if network is not None:
                self.initial.update({k: v.to("cpu") for k, v in network(bnn).items()})
        else:
            self.start_state = start_state
        current = _snapshot(bnn) if network is not None else None
        if network is not None:
            bnn.load_state_dict(self.initial or network(bnn), strict=False)
        try:
            self.start_correct = self._correct(deterministic=True)
        finally:
            if current is not None:
                bnn.load_state_dict(current, strict=False)
        # held on the CPU while the fit runs (512 ImageNet crops are 0.3 GB)
        self.rows = [(x.to("cpu"), y.to("cpu")) for x, y in self.rows]

    @torch.no_grad()
    def _correct(self, *, deterministic: bool) -> float:
        bnn = self.state.bnn
        if not deterministic:
            return count_correct(bnn, self.rows, lambda x: bnn.predictive(x, seed=0).probs,
                                 bnn.device)

        def logits(x: Any) -> torch.Tensor:
            with bnn.deterministic():
                try:
                    return logits_of(call_model(bnn.model, x))
                except Exception:  # a shape mistake is named as fit's first step names it
                    explain_shapes(bnn.model, lambda: call_model(bnn.model, x), inputs=x,
                                   where="fit")
                    raise

        return count_correct(bnn, self.rows, logits, bnn.device)

    def finish(self, record: dict[str, Any], family: str,
               guard: Callable[[], dict[str, Any]]) -> None:
        """After the spread guard: keep the end unless its training accuracy is clearly
        below the start's; else load the start, run ``guard`` (the spread guard) on it and
        mark ``record`` (``kept: "start"``)."""
        if not self.active:
            return
        state, bnn = self.state, self.state.bnn
        n = float(sum(y.shape[0] for _, y in self.rows))
        counts = state.all_reduce_sum(torch.tensor(
            [self.start_correct, self._correct(deterministic=False), n],
            dtype=torch.float64, device=bnn.device))
        total = int(counts[2])
        self.rows = []
        if total == 0:
            return
        start_acc, end_acc = float(counts[0]) / total, float(counts[1]) / total
        record.update({"start_train_accuracy": start_acc, "end_train_accuracy": end_acc})
        if not dropped(start_acc, end_acc, total):
            return
        tensors = self.initial if self.start_state is None else self.start_state(bnn)
        self.initial = None
        if tensors is None:
            return
        bnn.load_state_dict(tensors, strict=False)
        record.update(guard())
        record.update({"kept": "start", "worse_than_start": False})
        bnn.eval()
        if state.ctx.is_main:
            logger.warning(
                "fit of %r (no val_loader): the posterior ended at %.4f accuracy on %d training "
                "examples against the starting network's %.4f; the fit keeps the state it "
                "began with (lower the learning rate, fit more data, or pass a val_loader to "
                "judge the posterior on validation data)", family, end_acc, total, start_acc)
