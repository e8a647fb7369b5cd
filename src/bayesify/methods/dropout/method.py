"""dropout family: MC dropout (Gal & Ghahramani 2016) behind the shared predictor."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from bayesify.core.fitting import Step
from bayesify.core.method import wrapper_table
from bayesify.kit.family import NoiseFamily
from bayesify.kit.knobs import SpreadKnob
from bayesify.kit.steps import ElboStep, NothingToTrainStep, RoundRobin
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
            return NothingToTrainStep(
                "post-hoc MC dropout (train_weights=False, the default) has nothing to train: "
                "fit makes no optimiser step and only chooses the dropout rate and the "
                "temperature on validation data; bayesify(model, 'dropout', "
                "train_weights=True) fine-tunes the weights under dropout")
        # lr: the variational parameters are the pretrained weights: a fine-tuning LR.
        # clip_grad_norm 1: SGD moves whole weights by lr·g, and g grows with the logit
        # scale and with 1/σ of the frozen BatchNorm statistics (weights shrunk by weight
        # decay): on a BN CNN with 20× logits one unclipped step at 1e-3 sent the NLL to
        # 4e4 and the fit to chance accuracy. Bounding the step's norm keeps it a
        # fine-tuning step whatever the network's scales (issue 30).
        return ElboStep(RoundRobin(self.config.samples, 1), lr=0.001,
                        defaults={"clip_grad_norm": 1.0})
