"""Configuration of the iBNN family (defaults from the paper and its code)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import MethodConfig, option, require


@dataclass(frozen=True)
class IBNNConfig(MethodConfig):
    components: int = option(4, "K: number of mixture components of q(z) (an ensemble of K).")
    samples: int = option(
        2, "S: training repeats of every example; rows are dealt to components round-robin."
    )
    predict_samples: int = option(5, "n: noise samples per component at prediction (M = K·n).")
    prior_mean: float = option(1.0, "Mean of the Gaussian prior N(m, s²) on every node.")
    prior_std: float = option(0.1, "s: std of the prior (0.3 for VGG-like nets in the paper).")
    init_mean: float = option(1.0, "Centre of the initial component means.")
    init_mean_std: float = option(
        0.5, "σ0: component means start at N(init_mean, σ0²) (0.75 for VGG-like nets)."
    )
    init_std: tuple[float, float] = option(
        (0.05, 0.02), "(mean, std): softplus(ρ) starts at |N(mean, std²)|."
    )
    learn_std: bool = option(True, "Train the noise stds; False keeps them at their init.")

    def validate(self) -> None:
        require(isinstance(self.components, int) and self.components > 0,
                f"components must be a positive integer, got {self.components!r}")
        require(isinstance(self.samples, int) and self.samples > 0,
                f"samples must be a positive integer, got {self.samples!r}")
        require(isinstance(self.predict_samples, int) and self.predict_samples > 0,
                f"predict_samples must be a positive integer, got {self.predict_samples!r}")
        require(self.prior_std > 0, f"prior_std must be > 0, got {self.prior_std}")
        require(self.init_mean_std >= 0, f"init_mean_std must be >= 0, got {self.init_mean_std}")
        require(len(self.init_std) == 2 and self.init_std[0] >= 0 and self.init_std[1] >= 0,
                f"init_std must be (mean, std) >= 0, got {self.init_std!r}")
