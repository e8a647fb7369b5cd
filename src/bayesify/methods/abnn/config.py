"""Configuration of ABNN ("Make Me a BNN", Franchi et al., CVPR 2024)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import MethodConfig, laplace_heads_on, option, require


@dataclass(frozen=True)
class ABNNConfig(MethodConfig):
    """Multiplicative Gaussian noise on every normalisation layer's normalised activations."""

    laplace_heads: bool = laplace_heads_on()  # on by default (bayesify.kit.laplace_heads)

    components: int = option(
        3, "K: members, each with its own copy of every normalisation layer's γ, β "
        "(fine-tuned from the same pretrained values on its own share of the rows, with its own "
        "random prior when random_prior > 0). Prediction averages K members × predict_samples "
        "noise draws.")
    noise_std: float = option(
        0.05, "σ of y = γ·(x̂ ⊙ (1 + σ·ε)) + β, ε ~ N(0, 1) per row and channel (shared over "
        "pixels / tokens). 0 is the pretrained network bit for bit. Noise in every normalisation "
        "layer compounds with depth: 0.05 keeps a pretrained CNN or ViT within a point of its "
        "accuracy before any fine-tuning; the validation-tuned abnn_noise_scale sets the "
        "predictive σ (0 … σ: never more noise than the members were fine-tuned under).")
    per_network: bool = option(
        True, "noise_std is the network's at any depth: with L > 8 wrapped layers every "
        "layer's σ is noise_std·√(8/L), so L·σ² — how far independent noise in L layers moves "
        "the function — stays that of 8 layers. Measured on the real EfficientNet-Lite0 (49 "
        "BatchNorm-activation layers, a 10-way digit head), its predictive before any "
        "fine-tuning: σ = 0.05 on each layer 0.783 test accuracy against the network's 0.830 "
        "(NLL 0.83 against 0.63); 0.02 (√(8/49)·0.05) 0.828 (0.628). Networks with at most 8 "
        "normalisation layers (the quality protocols') are unchanged. False: noise_std on "
        "every layer.")
    prior_std: float = option(
        0.05, "s: Gaussian prior N(pretrained, s²) on every member's γ and β: the term "
        "Σ (γ_k − γ₀)² + (β_k − β₀)² / (2 s²), divided by N_train like a KL, keeps the members "
        "near the pretrained network.")
    random_prior: float = option(
        0.0, "ABNN's random prior: member k weighs the likelihood of class c by "
        "η_kc = 1 + random_prior·u_kc, u_kc ~ U[0, 1) fixed per member (prior_seed + k), so the "
        "members are pulled towards different modes. 0 (default): members differ by their rows "
        "and noise only, which keeps clean NLL at the start's on small training sets.")
    prior_seed: int = option(0, "Seed of the random class weights of random_prior.")
    samples: int = option(
        1, "Training repeats of every example, dealt to the K members round-robin (so each "
        "member trains on its own share of the rows: the fit costs one fine-tune, not K).")
    predict_samples: int = option(4, "n: noise draws per member at prediction (M = K·n members).")

    def validate(self) -> None:
        require(self.noise_std >= 0, f"noise_std must be >= 0, got {self.noise_std}")
        require(self.random_prior >= 0, f"random_prior must be >= 0, got {self.random_prior}")
        require(self.prior_seed >= 0, f"prior_seed must be >= 0, got {self.prior_seed}")
