"""rank1 family: rank-1 BNN with Gaussian posteriors on the factors (Dusenberry et al. 2020)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.method import wrapper_table
from bayesify.core.predictive_scale import SPREAD_GRID, add_knob, reset_knob, tune_knob
from bayesify.core.rank_one import RankOneLayer
from bayesify.core.tiled import TiledMethod
from bayesify.methods.rank1.config import Rank1Config

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

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


class Rank1Method(TiledMethod):
    """K members, each the base net with rank-1 Gaussian multiplicative factors.

    Loss: mean NLL over the K-tiled batch + β·mean_k KL_k / N_train (the trainer
    divides by N_train and anneals β). Prediction: K members × n samples, the
    posterior stds multiplied by the validation-tuned ``rank1_noise_scale``.
    """

    name = "rank1"
    config_cls = Rank1Config
    wrappers: ClassVar = wrapper_table(Rank1Layer)

    def prepare(self, bnn: BayesianModel) -> None:
        add_knob(bnn, KNOB, layers=bnn.bayesian_layers().values())

    def begin_fit(self, bnn: BayesianModel, *, steps_per_epoch: int, epochs: int) -> None:
        reset_knob(bnn, KNOB)

    def finish_fit(self, bnn: BayesianModel, *, train_loader: Any, val_loader: Any, ctx: Any,
                   batch_fn: Any = None) -> dict[str, Any]:
        """With ``val_loader``: the multiplier of the posterior stds of r and s (0 = the K
        member means) by validation NLL (shared one-SE search)."""
        return tune_knob(bnn, val_loader, name=KNOB, grid=SPREAD_GRID, batch_fn=batch_fn,
                         meaning="multiplier of the posterior std of r, s; 0 = member means")

    def default_lr(self) -> float:
        # r, s and ρ are O(1) multipliers whatever the network; each member's factors get
        # 1/K of the mean loss's gradient, so the step is scaled by K
        return 0.05 * self.components
