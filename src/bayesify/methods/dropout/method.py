"""dropout family: MC dropout (Gal & Ghahramani 2016) behind the shared predictor."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from bayesify.core.batch import Batch, call_model
from bayesify.core.fitting import FitContext, Step
from bayesify.core.method import wrapper_table
from bayesify.core.outputs import logits_of
from bayesify.kit.family import NoiseFamily
from bayesify.kit.knobs import SpreadKnob
from bayesify.kit.steps import ElboStep, NothingToTrainStep, RoundRobin, keeps_accuracy
from bayesify.methods.dropout.config import DropoutConfig
from bayesify.methods.dropout.layers import DropoutLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)

KNOB = "dropout_rate_scale"


class DropoutMethod(SpreadKnob, NoiseFamily):
    """Dropout before every target layer, kept on at prediction; no KL term.

    One component; training draws one mask per row (``samples`` repeats per
    example), prediction evaluates ``predict_samples`` fixed masks. Under
    ``deterministic()`` dropout is off (the weight-scaling approximation). Knob:
    ``dropout_rate_scale``, the multiplier of ``p`` at prediction (0 = the
    deterministic network), chosen on validation data.
    """

    name = "dropout"
    config_cls = DropoutConfig
    knob = KNOB
    knob_meaning = "multiplier of the dropout rate at prediction; 0 = no dropout"
    # every value scored: on the ViT protocol's seed 2 the rate ×0.5 gave clean validation
    # NLL 0.2365 between ×0.25 (0.2622) and ×0.75 (0.2600) — start 0.2596 — and a walk from
    # every other value never scored it (0.014 nats worse on test)
    knob_walk = False
    wrappers: ClassVar = wrapper_table(DropoutLayer)

    def prepare(self, bnn: BayesianModel) -> None:
        layers = list(bnn.bayesian_layers().values())
        if self.config.skip_input_layer and len(layers) > 1:
            first = bnn.targets[0]
            bnn.bayesian_layers()[first].p = 0.0
            logger.info("dropout: no dropout before the input layer %r (skip_input_layer)", first)
        super().prepare(bnn)

    def step(self) -> Step:
        if not self.config.train_weights:  # post-hoc: fit = the validation search
            return PostHocDropoutStep(self.config)
        # lr: the variational parameters are the pretrained weights: a fine-tuning LR.
        # clip_grad_norm 1: SGD moves whole weights by lr·g, and g grows with the logit
        # scale and with 1/σ of the frozen BatchNorm statistics (weights shrunk by weight
        # decay): on a BN CNN with 20× logits one unclipped step at 1e-3 sent the NLL to
        # 4e4 and the fit to chance accuracy. Bounding the step's norm keeps it a
        # fine-tuning step whatever the network's scales (issue 30).
        return ElboStep(RoundRobin(self.config.samples, 1), lr=0.001,
                        defaults={"clip_grad_norm": 1.0})


#: training examples (per process) the accuracy guard of a post-hoc fit without validation
#: predicts, and the rate multipliers it tries: at most ½ without validation (a network
#: that fits its training data perfectly shows no flipped training example at any rate,
#: while p = 0.05 lost 8 points of test accuracy on the 64-image BatchNorm CNN of the
#: stress matrix and ½ of it at most 1.5)
GUARD_ROWS = 2048
GUARD_SCALES = (0.5, 0.25, 0.1)


class PostHocDropoutStep(NothingToTrainStep):
    """Post-hoc MC dropout's fit: no optimiser step. With a ``val_loader`` the validation
    search chooses the rate multiplier and the temperature. Without one, the pass over the
    training data keeps the largest multiplier (½, ¼, 0.1, else 0) whose predictive loses
    at most ``keep_accuracy`` of the network's accuracy on the first :data:`GUARD_ROWS`
    training examples of each process (every rank counts its own, all choose from the
    sums): an untuned p = 0.05 before every depthwise convolution of a BatchNorm CNN had
    lost 15-20 points of test accuracy. Both the accuracy and the *expected* accuracy (the
    mean probability of the true label, the accuracy of a label drawn from the predictive)
    must keep within it: on a training set the network has memorised the first shows no
    flipped example at any rate, while the second still falls with the rate — the stress
    matrix's batch-of-one network (seed 1): accuracy 1.000 at every multiplier, expected
    accuracy 0.869 → 0.861 / 0.853 / 0.836 at 0.1 / ¼ / ½, validation accuracy 0.793 →
    0.797 / 0.783 / 0.770 (½, chosen by accuracy alone, cost 2.3 points)."""

    def __init__(self, config: DropoutConfig) -> None:
        super().__init__(
            "post-hoc MC dropout (train_weights=False, the default) has nothing to train: fit "
            "makes no optimiser step and only chooses the dropout rate and the temperature "
            "(on validation data; without it, the largest rate that keeps the training "
            "accuracy); bayesify(model, 'dropout', train_weights=True) fine-tunes the weights "
            "under dropout")
        self.config = config
        self._correct: torch.Tensor | None = None

    def begin(self, ctx: FitContext) -> None:
        self._correct = None

    @torch.no_grad()
    def step(self, batch: Batch, ctx: FitContext) -> None:
        if ctx.validating or self.config.keep_accuracy is None:
            return
        bnn = ctx.bnn
        correct = self._correct
        if correct is None:  # [accuracy: network, scales…; expected accuracy: the same; n]
            correct = self._correct = torch.zeros(2 * _CANDIDATES + 1, dtype=torch.float64,
                                                  device=bnn.device)
        take = GUARD_ROWS - int(correct[-1])
        if take <= 0:
            return
        inputs, labels = batch.model_input(), batch.require_labels("fit")
        if correct[-1] > 0 and labels.shape[0] > take:
            return  # whole batches only (inputs of any structure); at least the first
        with bnn.deterministic():
            _count(correct, 0, logits_of(call_model(bnn.model, inputs)).float().softmax(-1),
                   labels)
        before = bnn.state.value(KNOB)
        try:
            for k, scale in enumerate(GUARD_SCALES):
                bnn.state.set(KNOB, scale)
                probs = bnn.predictive(inputs, samples_per_component=self.config.predict_samples,
                                       seed=0).probs
                _count(correct, k + 1, probs, labels)
        finally:
            bnn.state.set(KNOB, before)
        correct[-1] += labels.shape[0]

    def end(self, ctx: FitContext) -> dict[str, Any]:
        if ctx.validating or self.config.keep_accuracy is None:
            return {}
        bnn = ctx.bnn
        local = self._correct if self._correct is not None else torch.zeros(
            2 * _CANDIDATES + 1, dtype=torch.float64, device=bnn.device)
        self._correct = None
        n_local = local[-1:]
        guard = keeps_accuracy(ctx, torch.cat([local[:_CANDIDATES], n_local]),
                               self.config.keep_accuracy)
        expected = keeps_accuracy(ctx, torch.cat([local[_CANDIDATES:-1], n_local]),
                                  self.config.keep_accuracy)
        if guard is None or expected is None:
            return {}
        (chosen, accuracy, n), (chosen_expected, expected_accuracy, _) = guard, expected
        # the largest multiplier both keep (candidates in the order tried, largest first)
        chosen = (None if chosen is None or chosen_expected is None
                  else max(chosen, chosen_expected))
        scale = 0.0 if chosen is None else GUARD_SCALES[chosen]
        if scale != bnn.state.value(KNOB):
            bnn.state.set(KNOB, scale)
            if ctx.rank == 0:
                logger.info(
                    "dropout: no val_loader to choose the rate on; %s set to %g, the largest "
                    "of %s whose predictive keeps the network's accuracy and expected accuracy "
                    "on %d training examples within %g (pass a val_loader to choose it on "
                    "validation data)",
                    KNOB, scale, GUARD_SCALES, n, self.config.keep_accuracy)
        at = 0 if chosen is None else chosen + 1
        return {KNOB: bnn.state.value(KNOB), "guard_train_accuracy_map": accuracy[0],
                "guard_train_accuracy": accuracy[at],
                "guard_train_expected_accuracy_map": expected_accuracy[0],
                "guard_train_expected_accuracy": expected_accuracy[at]}


#: the guard's candidates: the network, then every multiplier of :data:`GUARD_SCALES`
_CANDIDATES = len(GUARD_SCALES) + 1


def _count(sums: torch.Tensor, k: int, probs: torch.Tensor, labels: torch.Tensor) -> None:
    """Add candidate ``k``'s correct predictions and its probabilities of the true labels to
    the guard's sums (the layout of :meth:`PostHocDropoutStep.step`)."""
    sums[k] += (probs.argmax(-1) == labels).sum()
    sums[_CANDIDATES + k] += probs.gather(-1, labels.long().unsqueeze(-1)).sum()
