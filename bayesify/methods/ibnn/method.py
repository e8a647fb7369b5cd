"""iBNN family: registry entry, type → wrapper table, training/prediction layout."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from bayesify.core.method import Method
from bayesify.methods.ibnn.config import IBNNConfig
from bayesify.methods.ibnn.layers import NodeNoiseLayer


class IBNNMethod(Method):
    """Multiplicative node noise with a K-component mixture posterior.

    Training (Algorithm 1): every example repeated ``samples`` times, rows dealt
    to components round-robin (inherited default). Prediction: every component
    with ``predict_samples`` draws, averaged in probability space.
    """

    name = "ibnn"
    config_cls = IBNNConfig
    wrappers: ClassVar = {
        nn.Linear: NodeNoiseLayer,
        nn.Conv1d: NodeNoiseLayer,
        nn.Conv2d: NodeNoiseLayer,
        nn.Conv3d: NodeNoiseLayer,
        nn.ConvTranspose1d: NodeNoiseLayer,
        nn.ConvTranspose2d: NodeNoiseLayer,
        nn.ConvTranspose3d: NodeNoiseLayer,
    }

    def default_lr(self) -> float:
        # every component sees 1/K of the rows of the mean loss: scale the step by K
        return 0.05 * self.components

    @classmethod
    def demo_recipe(cls) -> dict[str, Any]:
        return {
            "options": {"components": 4, "samples": 2, "init_mean_std": 0.25, "prior_std": 0.1},
            "fit": {"epochs": 30, "kl_anneal_epochs": 10},
            "predictor": {"samples_per_component": 5},
        }
