"""Configuration of the mean-field family (Bayes by Backprop, Blundell et al. 2015)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import laplace_heads_on, option, require
from bayesify.kit.priors import WeightPriorConfig

SAMPLING_MODES = ("local_reparam", "flipout", "weights")
PREDICT_SAMPLING_MODES = ("auto", "weights", "local_reparam")
KL_WEIGHTINGS = ("uniform", "blundell")


@dataclass(frozen=True)
class MeanFieldConfig(WeightPriorConfig):
    """Bayes by Backprop: a Gaussian per weight around the pretrained weights (Blundell et al.)."""

    laplace_heads: bool = laplace_heads_on()  # on by default (bayesify.kit.laplace_heads)

    prior: str = option(
        "gaussian",
        "Weight prior: 'gaussian' N(0, σ²) (default), 'relative' N(w₀, (σ·max(|w₀|, floor))²), "
        "'pretrained' N(w₀, σ²) or 'scale_mixture' π N(0, σ₁²) + (1−π) N(0, σ₂²). Why the wide "
        "N(0, 1): the KL's curvature in μ is 1/(σ²·N_train), so SGD on μ is stable only for "
        "lr < 2σ²·N_train — a tight prior (relative, σ ~ 0.1·|w₀|) diverges at any useful LR "
        "on a small fine-tuning set, while N(0, 1) pulls μ and σ by only ~lr/batch per epoch.",
    )
    prior_std: float = option(
        1.0, "σ of the prior: absolute for 'gaussian' and 'pretrained', a fraction of |w₀| for "
        "'relative'.")
    samples: int = option(
        1, "S: training repeats of every example (each repeat its own noise / weight sample)."
    )
    predict_samples: int = option(
        10, "M: posterior samples (members) at prediction (10: a stable mixture at 10× cost).")
    delta: float = option(
        0.05, "δ: initial posterior std softplus(ρ) = δ·max(|w|, init_floor); μ starts at w, "
        "so fine-tuning starts at the pretrained network with spread relative to each weight "
        "(5 per cent: 10 per cent cost a pretrained digits CNN a point; the tuned meanfield_std_scale widens "
        "it where validation data asks for it)."
    )
    init_floor: float = option(
        1e-3, "Floor on |w| when setting the initial std, so zero weights get a posterior too."
    )
    sampling: str = option(
        "local_reparam",
        "Training estimator: 'local_reparam' (sample pre-activations, per-row noise), "
        "'flipout' (one weight perturbation per batch, per-row random signs) or 'weights' "
        "(one weight sample per tiled repeat, batched).",
    )
    predict_sampling: str = option(
        "auto",
        "Prediction: 'weights' (every member is a network with its own weight sample), "
        "'local_reparam' (per-member pre-activation noise), or 'auto': the model that was "
        "trained — 'local_reparam' after local_reparam training (for convs it is a different "
        "model: noise independent over pixels), 'weights' after flipout/weights training.",
    )
    kl_weighting: str = option(
        "uniform",
        "Minibatch KL weight: 'uniform' (KL/N_train every step) or 'blundell' "
        "(π_i = 2^(M−i)/(2^M−1) for step i of M per epoch).",
    )
    bias: bool = option(True, "Also put a posterior on the biases of wrapped layers.")
    per_network: bool = option(
        False, "δ and the learning rate for the whole network, not per layer: both divided by "
        "√L for L wrapped layers. Not the default: on the real EfficientNet-Lite0 it kept a "
        "fit worse than the network's Laplace heads (per layer, the fit collapses and is "
        "replaced by the start: benchmarks/results/session8.md).")
    rho_lr_scale: float = option(
        1.0, "Learning-rate multiplier of the ρ (std) parameters relative to μ. With Adam a step "
        "changes σ by about lr·scale relatively, so σ needs a larger step than μ to move "
        "within a short fine-tuning run."
    )

    def validate(self) -> None:
        super().validate()
        require(isinstance(self.samples, int) and self.samples > 0,
                f"samples must be a positive integer, got {self.samples!r}")
        require(isinstance(self.predict_samples, int) and self.predict_samples > 0,
                f"predict_samples must be a positive integer, got {self.predict_samples!r}")
        require(self.delta > 0, f"delta must be > 0 (use a tiny value for a near-point mass), "
                                f"got {self.delta}")
        require(self.init_floor > 0, f"init_floor must be > 0, got {self.init_floor}")
        require(self.sampling in SAMPLING_MODES,
                f"sampling must be one of {SAMPLING_MODES}, got {self.sampling!r}")
        require(self.predict_sampling in PREDICT_SAMPLING_MODES,
                f"predict_sampling must be one of {PREDICT_SAMPLING_MODES}, "
                f"got {self.predict_sampling!r}")
        require(self.rho_lr_scale > 0, f"rho_lr_scale must be > 0, got {self.rho_lr_scale}")
        require(self.kl_weighting in KL_WEIGHTINGS,
                f"kl_weighting must be one of {KL_WEIGHTINGS}, got {self.kl_weighting!r}")
