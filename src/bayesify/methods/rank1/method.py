"""rank1 family: rank-1 BNN with Gaussian posteriors on the factors (Dusenberry et al. 2020)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.fitting import Step
from bayesify.core.method import wrapper_table
from bayesify.kit.knobs import SpreadKnob
from bayesify.kit.rank_one import RankOneLayer, RankOneTiledMethod, network_state
from bayesify.kit.steps import ElboStep, Tiled
from bayesify.methods.rank1.config import Rank1Config

KNOB = "rank1_noise_scale"


class Rank1Layer(RankOneLayer):
    """Rank-1 BNN layer: ``r_k ~ N(μ_r,k, σ_r,k²)``, ``s_k ~ N(μ_s,k, σ_s,k²)``, prior N(1, s²)."""

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: Rank1Config) -> None:
        super().__init__(
            base_layer, context=context, components=config.components, init=config.init,
            sign_prob=config.sign_prob, init_mean_std=config.init_mean_std,
            member_bias=config.member_bias, stochastic=True, init_std=config.init_std,
            learn_std=config.learn_std, prior_mean=config.prior_mean, prior_std=config.prior_std,
        )


class Rank1Method(SpreadKnob, RankOneTiledMethod):
    """K members, each the base net with rank-1 Gaussian multiplicative factors.

    Loss: mean NLL over the K-tiled batch + β·mean_k KL_k / N_train (the trainer
    divides by N_train and anneals β). Prediction: K members × n samples, the
    posterior stds multiplied by the validation-tuned ``rank1_noise_scale``.
    """

    name = "rank1"
    config_cls = Rank1Config
    knob = KNOB
    knob_meaning = "multiplier of the posterior std of r, s; 0 = member means"
    wrappers: ClassVar = wrapper_table(Rank1Layer)

    def step(self) -> Step:
        # lr: r, s and ρ are O(1) multipliers; each member's factors
        # get 1/K of the mean loss's gradient, so the step is scaled by K
        # clip_grad_norm 1: the factors are O(1) but their gradient is not — it scales with
        # the logits (×20 logits: gradient ×20, so one step at this lr multiplied channels
        # by 5 and the loss reached 1e20 in 3 steps: rank1's KL 6.6e29, batchensemble's
        # NaN NLL with KL 0, iBNN's NaN). Bounding the step's norm keeps the step size
        # the lr promises whatever the network's logit scale; it rarely binds otherwise.
        # lr_schedule cosine: as batchensemble's factors, rank-1 factors still move ~10 % a
        # step at the end of a constant-rate run; without a validation split the last
        # iterate of a depthwise BN CNN ended 11 points below its start (issue 30; annealed:
        # 5 above)
        step = ElboStep(Tiled(self.components), lr=0.05 * self.components,
                        defaults={"clip_grad_norm": 1.0, "lr_schedule": "cosine"})
        step.network_state = network_state  # the start as the network itself
        return step
