"""Bayes by Hypernet: registry entry, shared noise, training layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer
from bayesify.core.method import Method, wrapper_table
from bayesify.core.weight_members import export_weight_members
from bayesify.core.weightspace import member_training_forward
from bayesify.methods.hypernet.config import HypernetConfig
from bayesify.methods.hypernet.generator import NoiseSource
from bayesify.methods.hypernet.layers import HypernetLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


class HypernetMethod(Method):
    """An implicit weight posterior: per-layer generator MLPs fed with noise.

    Training: every example repeated ``samples`` times, every repeat one
    generated network (one tiled forward), mean NLL over all of them + the
    nearest-neighbour KL / N_train. Prediction: ``predict_samples`` generated
    networks, seeded per member.
    """

    name = "hypernet"
    config_cls = HypernetConfig
    wrappers: ClassVar = wrapper_table(HypernetLayer)

    def __init__(self, config: HypernetConfig) -> None:
        super().__init__(config)
        self.noise = NoiseSource(config.noise_dim, shared=config.noise == "shared")

    def wrap(self, name: str, module: nn.Module, context: SamplingContext) -> BayesianLayer:
        return HypernetLayer(module, context=context, config=self.config, noise=self.noise)

    def prepare(self, bnn: BayesianModel) -> None:
        bnn.context.track_passes = self.noise.shared  # one shared z per forward pass

    def training_forward(
        self, bnn: BayesianModel, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return member_training_forward(bnn, x, y, self.config.samples)

    def export_module(
        self, bnn: BayesianModel, *, samples_per_component: int, seed: int, example_input: torch.Tensor
    ) -> nn.Module:
        """M generated networks, materialised as plain copies of the base network."""
        return export_weight_members(bnn, samples_per_component=samples_per_component, seed=seed,
                                     example_input=example_input)

    def default_lr(self) -> float:
        # generator MLPs: use optimizer="adam" with 1e-4 (the paper's) for best results
        return 1e-3

    @classmethod
    def demo_recipe(cls) -> dict[str, Any]:
        return {
            "options": {"prior": "pretrained", "prior_std": 0.1, "samples": 2},
            # the paper's Adam step for BbH (1e-4): larger steps let the KL (N ≈ 630
            # digits) widen the posterior faster than the likelihood can hold it
            "fit": {"epochs": 20, "optimizer": "adam", "lr": 1e-4},
            "predictor": {"samples_per_component": 16},
        }
