"""iBNN family: registry entry, type → wrapper table, training/prediction layout."""

from __future__ import annotations

from typing import ClassVar

from bayesify.core.fitting import Step
from bayesify.core.method import wrapper_table
from bayesify.kit.family import NoiseFamily
from bayesify.kit.knobs import SpreadKnob
from bayesify.kit.steps import ElboStep, RoundRobin
from bayesify.methods.ibnn.config import IBNNConfig
from bayesify.methods.ibnn.layers import NodeNoiseLayer

KNOB = "ibnn_noise_scale"


class IBNNMethod(SpreadKnob, NoiseFamily):
    """Multiplicative node noise with a K-component mixture posterior.

    Training (Algorithm 1): every example repeated ``samples`` times, rows dealt
    to components round-robin. Prediction: every component with ``predict_samples``
    draws, averaged in probability space.
    """

    name = "ibnn"
    config_cls = IBNNConfig
    knob = KNOB
    knob_meaning = "multiplier of the learned node-noise std; 0 = component means"
    wrappers: ClassVar = wrapper_table(NodeNoiseLayer, transposed=True)

    def step(self) -> Step:
        # lr: the paper's variational LR for pretrained ResNet-50 (large, constant, no
        # weight decay): the means and ρ are O(1) multipliers whatever the network, so
        # one step size fits every network
        return ElboStep(RoundRobin(self.config.samples, self.components), lr=0.2)
