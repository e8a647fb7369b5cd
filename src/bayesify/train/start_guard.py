"""Never worse than the start without validation data: the training examples decide.

With a ``val_loader`` a fit hands back its last state only when it is not clearly worse
than the network it started from (:mod:`bayesify.train.best`). Without one nothing checked
that, and on the real EfficientNet-Lite0 (50 wrapped layers, a 10-way digit head, 300
training images) two families ended far below it: Bayes by Backprop at 0.75 test accuracy
and MNF at 0.72 against the network's 0.83, their mean networks at 0.44 training accuracy
after ten steps (the spread guard, :mod:`bayesify.train.spread_guard`, compares a spread with
the mean network, which had already moved). So a fresh gradient fit without validation
data predicts up to :data:`ROWS` training examples (over the processes, the first of each
process's contiguous shard; a shuffling loader's order drawn under :data:`ROWS_SEED`, so a
resumed fit compares the same rows) with the network it starts from (the posterior mean at the
start: the pretrained weights), before the first step, and with the posterior it ends with,
after the spread guard. Where the posterior's accuracy there is *clearly* lower —
by more than a point and by more than a few examples (:func:`dropped`, the rule of
:func:`bayesify.train.best.clearly_worse`) — the fit hands back the state it began with (the
network as a posterior; its spread guarded again) and warns. Counts are summed over the
ranks, so every rank decides alike; a checkpoint carries the starting state
(:meth:`StartGuard.carry`), so a resumed fit decides as the uninterrupted one. Training
accuracy cannot see every loss (a network that fits its training set shows none);
validation data remains the way to judge a posterior.
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
from bayesify.train.best import ACCURACY_MARGIN, FLIPPED_EXAMPLES, _snapshot, starting_state

if TYPE_CHECKING:
    from bayesify.train.context import TrainContext

logger = logging.getLogger(__name__)

#: training examples (over the processes) the start and the end are compared on
ROWS = 512
#: the seed of the global generator while those rows are drawn (a shuffling loader)
ROWS_SEED = 0


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

    def __init__(self, state: TrainContext, *, fresh: bool,
                 carried: tuple[dict[str, Any], dict[str, Any]] | None = None) -> None:
        """``carried``: what :meth:`carry` wrote into the checkpoint a fit resumes from (the
        starting state of a family that trains its posterior); the start's count is then
        taken again, on the same rows, from that state."""
        step, bnn = state.family, state.bnn
        trains = getattr(step, "trains_posterior", False)
        start_state = getattr(step, "start_state", None)
        self.state = state
        self.active = ((fresh or carried is not None) and state.val_loader is None
                       and step.optimizes and (trains or start_state is not None))
        self.initial: dict[str, torch.Tensor] | None = None
        self.start_state: Callable[[Any], dict[str, torch.Tensor]] | None = None
        if not self.active:
            return
        if carried is not None and (not carried[0].get("active")
                                    or (trains and "initial" not in carried[1])):
            self.active = False  # a checkpoint of a run that had no start to compare with
            return
        # the same rows in a fresh fit and a resumed one, whatever the RNG stream holds: a
        # shuffling loader draws its order from the global generator, forked and seeded here
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ROWS_SEED)
            self.rows = state.labelled_rows(ROWS)
        network = getattr(step, "network_state", None)  # the start as the network itself
        if trains and carried is not None:
            self.initial = carried[1]["initial"]
        elif trains:  # held on the CPU for the whole fit (an ensemble's copies are its size)
            self.initial = starting_state(bnn)
        else:
            self.start_state = start_state
        # resumed: the model holds a trained state; the start is loaded to be counted
        starting = (self.initial if trains else start_state(bnn)) if carried is not None \
            else (self.initial or network(bnn)) if network is not None else None
        current = _snapshot(bnn) if starting is not None else None
        if starting is not None:
            bnn.load_state_dict(starting, strict=False)
        try:
            self.start_correct = self._correct(deterministic=True)
        finally:
            if current is not None:
                bnn.load_state_dict(current, strict=False)
        # held on the CPU while the fit runs (512 ImageNet crops are 0.3 GB)
        self.rows = [(x.to("cpu"), y.to("cpu")) for x, y in self.rows]

    def carry(self) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """What a checkpoint holds of this guard, ``(numbers, tensors)``: the starting state
        of a family that trains its posterior (a trajectory family's start is rebuilt by
        its step). Nothing for an inactive guard."""
        if not self.active:
            return {}, {}
        return {"active": True}, ({"initial": self.initial} if self.initial is not None else {})

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
