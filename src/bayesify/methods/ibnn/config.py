"""Configuration of the iBNN family (defaults from the paper and its code)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import MethodConfig, laplace_heads_on, option, require


@dataclass(frozen=True)
class IBNNConfig(MethodConfig):
    """Implicit BNN: multiplicative node noise, a K-component Gaussian mixture (Trinh et al.)."""

    laplace_heads: bool = laplace_heads_on()  # on by default (bayesify.kit.laplace_heads)

    components: int = option(
        4, "K: mixture components of q(z) (an ensemble of K); 4 is the paper's smallest "
        "setting and costs 4× a forward pass per example at prediction.")
    samples: int = option(
        2, "S: training repeats of every example (the paper's S = 2), dealt to components "
        "round-robin, so every component trains on every other example."
    )
    predict_samples: int = option(
        2, "n: noise samples per component at prediction (M = K·n = 8 members). n = 5 (20 "
        "members) gave the same quality within seed noise on the CNN, ViT and text "
        "protocols at 2.5x the prediction cost and a slower validation search "
        "(benchmarks/results/session24.md).")
    prior_mean: float = option(
        1.0, "Mean of the Gaussian prior N(m, s²) on every node: 1 is the pretrained network.")
    prior_std: float = option(
        0.1, "s: std of the prior on the network (the paper's 0.1 per node; 0.3 for VGG-like "
        "nets). With per_network (the default) every node's prior std is s/√L, L the wrapped "
        "layers: with a few hundred examples the posterior ends near its prior, and 0.1 per "
        "node over EfficientNet-Lite0's 50 layers is a prior that the network is destroyed "
        "(training NLL 0.02 → 1.1 in 8 epochs). The validation search sets the predictive "
        "spread after training.")
    init_mean: float = option(1.0, "Centre of the initial component means (1: the pretrained net).")
    init_mean_std: float = option(
        0.1, "σ0: the spread of the initial component means (offsets from init_mean); with "
        "per_network every layer's means start at N(init_mean, σ0²/L), so the components start "
        "within ~σ0 (10 per cent) of the pretrained function whatever the depth (σ0 per layer "
        "compounded over EfficientNet-Lite0's ~50 layers to 0.93 → 0.62 accuracy before any "
        "step; the paper's 0.5 is meant for training from scratch).")
    init_std: tuple[float, float] = option(
        (0.05, 0.02), "(mean, std): softplus(ρ) starts at |N(mean, std²)| (the paper's values: "
        "5 per cent multiplicative noise, half the prior's); with per_network both are divided "
        "by √L, like the prior (0.05 per node over 50 layers: validation NLL 0.30 → 0.44 before "
        "any step; divided, 0.24).")
    per_network: bool = option(
        True, "Spread options for the whole network, not per layer: prior_std, init_mean_std, "
        "init_std and the learning rate (0.2, the paper's) are divided by √L for L wrapped "
        "layers, since L layers' independent perturbations move the function like one of √L "
        "times the size. L = 1 (targets='last_layer') is the paper's recipe; False gives it "
        "per node on any network.")
    entropy_weight: float = option(
        0.0, "γ: the training loss is NLL + (KL(q̂‖p) − γ·H[q̂]) / N (the entropy-regularised "
        "ELBO of Trinh et al., ICML 2022, for covariate shift: a broader q(z) simulates "
        "more input corruptions in training). 0 is the ELBO.")
    learn_std: bool = option(
        True, "Train the noise stds (what makes the posterior Bayesian); False keeps them at "
        "their init.")

    def validate(self) -> None:
        require(isinstance(self.components, int) and self.components > 0,
                f"components must be a positive integer, got {self.components!r}")
        require(isinstance(self.samples, int) and self.samples > 0,
                f"samples must be a positive integer, got {self.samples!r}")
        require(isinstance(self.predict_samples, int) and self.predict_samples > 0,
                f"predict_samples must be a positive integer, got {self.predict_samples!r}")
        require(self.prior_std > 0, f"prior_std must be > 0, got {self.prior_std}")
        require(self.entropy_weight >= 0,
                f"entropy_weight must be >= 0, got {self.entropy_weight}")
        require(self.init_mean_std >= 0, f"init_mean_std must be >= 0, got {self.init_mean_std}")
        require(len(self.init_std) == 2 and self.init_std[0] >= 0 and self.init_std[1] >= 0,
                f"init_std must be (mean, std) >= 0, got {self.init_std!r}")
