"""Configuration of MC dropout (Gal & Ghahramani 2016)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import MethodConfig, laplace_heads_on, option, require

GRANULARITIES = ("element", "channel")


@dataclass(frozen=True)
class DropoutConfig(MethodConfig):
    """MC dropout before every target layer, kept on at prediction (Gal & Ghahramani)."""

    laplace_heads: bool = laplace_heads_on()  # on by default (bayesify.kit.laplace_heads)

    p: float = option(
        0.05, "Dropout rate before every target layer (kept active at prediction). A pretrained "
        "network was rarely trained with dropout everywhere: 5 per cent keeps it within a point "
        "of its accuracy; the validation-tuned dropout_rate_scale sets the predictive rate "
        "(0 … 2·p).")
    skip_input_layer: bool = option(
        True, "No dropout before the first target layer (the stem / first projection sees the "
        "raw input: dropping pixels or embedding features corrupts the data, not features).")
    granularity: str = option(
        "element", "'element': one Bernoulli per activation (Gal & Ghahramani); 'channel': one "
        "per input channel, shared over pixels / tokens (spatial dropout)."
    )
    train_weights: bool = option(
        False, "True: fine-tune the target layers' weights under dropout (the variational "
        "parameters M of q(W) = M·diag(Bernoulli), a copy initialised from the pretrained "
        "weights; the base layer stays untouched). False (the default): post-hoc MC dropout on "
        "the frozen network, fit only chooses the rate and temperature on validation data. "
        "Fine-tuning gave no better shift NLL or OOD AUROC on the quality protocols and lost "
        "1.2-1.6 points of test accuracy on one seed of three (benchmarks/RESULTS.md)."
    )
    keep_accuracy: float | None = option(
        0.01, "Post-hoc dropout fitted without a val_loader: the rate multiplier is the largest "
        "of 0.5, 0.25, 0.1, 0 whose predictive's accuracy and expected accuracy (mean "
        "probability of the true label) on the training examples (the first 2048 of each "
        "process) are within this much of the network's. None: keep the rate p untouched. "
        "With a val_loader the validation search chooses it.")
    samples: int = option(1, "Training repeats of every example (each with its own mask).")
    predict_samples: int = option(8, "M: dropout masks (members) at prediction.")

    def validate(self) -> None:
        require(0.0 <= self.p < 1.0, f"p must be in [0, 1), got {self.p}")
        require(self.granularity in GRANULARITIES,
                f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        require(self.keep_accuracy is None or 0 <= self.keep_accuracy < 1,
                f"keep_accuracy must be None or in [0, 1), got {self.keep_accuracy!r}")
        require(isinstance(self.samples, int) and self.samples > 0,
                f"samples must be a positive integer, got {self.samples!r}")
        require(isinstance(self.predict_samples, int) and self.predict_samples > 0,
                f"predict_samples must be a positive integer, got {self.predict_samples!r}")
