"""Configuration of BatchEnsemble (defaults from Wen et al. 2020)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import MethodConfig, laplace_heads_on, option, require
from bayesify.kit.rank_one import INIT_CHOICES


@dataclass(frozen=True)
class BatchEnsembleConfig(MethodConfig):
    """Deterministic rank-1 fast weights, K members sharing one network (Wen et al. 2020)."""

    laplace_heads: bool = laplace_heads_on()  # on by default (bayesify.kit.laplace_heads)

    components: int = option(
        4, "K: ensemble members (fast-weight pairs r_k, s_k per layer); the paper's 4.")
    init: str = option(
        "normal", "Initial fast weights: 'normal' (N(1, init_std²): members near the pretrained "
        "net), 'random_sign' (±1, P(+1) = sign_prob) or 'ones' (r = s = 1: every member is the "
        "base network, no diversity)."
    )
    init_std: float = option(
        0.1, "Std of the 'normal' init of the fast weights around 1. 0.1 gives members that "
        "differ by ~10 per cent per channel; the paper's 0.5 (training from scratch) moves a pretrained "
        "net so far that a fine-tune diverges (NaN at step 3–4 at the default LR).")
    sign_prob: float = option(0.5, "P(+1) of the 'random_sign' init.")
    fast_lr_mult: float = option(
        0.5, "Learning-rate multiplier of the fast weights r, s relative to the other "
        "posterior tensors (per-member biases, per-member BN); 0.25–0.5 in the paper: the "
        "fast weights multiply whole channels, so they need the smaller step."
    )
    per_network: bool = option(
        True, "Spread options for the whole network, not per layer: the initial fast weights' offsets from 1 (init_std) are divided "
        "by √(2L) for L wrapped layers (two factor vectors each), so a network of any depth "
        "starts within ~init_std of its function (per layer, the second quality protocol's "
        "tiny ViT started 0.016 nats of validation NLL above its network). False: per layer, "
        "the paper's recipe for training from scratch.")
    member_bias: bool = option(
        True, "A bias per member (from the base bias) where the layer has one: cheap diversity.")
    per_member_bn: bool = option(
        False, "One BatchNorm (statistics + γ, β) per member, initialised from the pretrained "
        "BN; False (default: no extra state) shares the frozen pretrained BN."
    )

    def validate(self) -> None:
        require(isinstance(self.components, int) and self.components > 0,
                f"components must be a positive integer, got {self.components!r}")
        require(self.init in INIT_CHOICES, f"init must be one of {INIT_CHOICES}, got {self.init!r}")
        require(self.init_std >= 0, f"init_std must be >= 0, got {self.init_std}")
        require(0.0 <= self.sign_prob <= 1.0, f"sign_prob must be in [0, 1], got {self.sign_prob}")
        require(self.fast_lr_mult > 0, f"fast_lr_mult must be > 0, got {self.fast_lr_mult}")
