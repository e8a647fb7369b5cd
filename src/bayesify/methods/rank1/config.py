"""Configuration of the rank-1 BNN family (defaults from Dusenberry et al. 2020)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import MethodConfig, laplace_heads_on, option, require
from bayesify.kit.rank_one import INIT_CHOICES


@dataclass(frozen=True)
class Rank1Config(MethodConfig):
    """Rank-1 BNN: Gaussian rank-1 factors W∘(s rᵀ), K members (Dusenberry et al. 2020)."""

    laplace_heads: bool = laplace_heads_on()  # on by default (bayesify.kit.laplace_heads)

    components: int = option(
        4, "K: ensemble members (rank-1 factor pairs r_k, s_k per layer); the paper's 4.")
    predict_samples: int = option(
        2, "n: samples per member at prediction (M = K·n; the paper's 2 per member).")
    init: str = option(
        "normal",
        "Initial means of r and s: 'normal' (N(1, init_mean_std²): members start near the "
        "pretrained network), 'random_sign' (±1, P(+1) = sign_prob: the paper's choice for "
        "training from scratch; it erases a pretrained function) or 'ones' (r = s = 1).",
    )
    sign_prob: float = option(0.5, "P(+1) of the random-sign init (0.5–0.75 in the paper).")
    init_mean_std: float = option(
        0.1, "Std of the 'normal' init of the means around 1: members differ by ~10 per cent per "
        "channel, diverse yet within reach of the pretrained function.")
    init_std: float = option(
        0.03, "Initial posterior std softplus(ρ) of r and s (the paper's 0.03).")
    learn_std: bool = option(
        True, "Train the posterior stds (what makes the members Bayesian); False keeps them "
        "at init_std.")
    prior_mean: float = option(
        1.0, "Mean of the Gaussian prior N(m, s²) on every r and s entry: 1 is the pretrained net.")
    prior_std: float = option(
        0.1, "Std of the prior (the paper's 0.1; 0.05 on ImageNet). The validation-tuned "
        "rank1_noise_scale corrects the predictive spread.")
    per_network: bool = option(
        True, "Spread options for the whole network, not per layer: the initial means' offsets from 1 (init_mean_std), the posterior stds (init_std) and the prior std are divided "
        "by √(2L) for L wrapped layers (two factor vectors each), so a network of any depth "
        "starts within ~init_std of its function (per layer, the second quality protocol's "
        "tiny ViT started 0.016 nats of validation NLL above its network). False: per layer, "
        "the paper's recipe for training from scratch.")
    member_bias: bool = option(
        True, "A bias per member (from the base bias) where the layer has one: cheap diversity.")
    per_member_bn: bool = option(
        False, "One BatchNorm (statistics + γ, β) per member, initialised from the pretrained "
        "BN; False (default: no extra state, statistics the members share were estimated on "
        "far more data) shares the frozen pretrained BN."
    )

    def validate(self) -> None:
        require(isinstance(self.components, int) and self.components > 0,
                f"components must be a positive integer, got {self.components!r}")
        require(isinstance(self.predict_samples, int) and self.predict_samples > 0,
                f"predict_samples must be a positive integer, got {self.predict_samples!r}")
        require(self.init in INIT_CHOICES, f"init must be one of {INIT_CHOICES}, got {self.init!r}")
        require(0.0 <= self.sign_prob <= 1.0, f"sign_prob must be in [0, 1], got {self.sign_prob}")
        require(self.init_mean_std >= 0, f"init_mean_std must be >= 0, got {self.init_mean_std}")
        require(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")
        require(self.prior_std > 0, f"prior_std must be > 0, got {self.prior_std}")
