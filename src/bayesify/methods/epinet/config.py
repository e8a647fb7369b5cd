"""Configuration of the epinet (Osband et al., "Epistemic neural networks", NeurIPS 2023)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bayesify.core.config import MethodConfig, laplace_heads_on, option, require


@dataclass(frozen=True)
class EpinetConfig(MethodConfig):
    """``f(x, z) = base(x) + σ_L(φ(x), z) + α·σ_P(φ(x), z)`` on the classifier's input φ."""

    laplace_heads: bool = laplace_heads_on()  # on by default (bayesify.kit.laplace_heads)
    targets: Any = option(
        "last_layer", "The classifier whose input φ(x) (the penultimate features) feeds the "
        "epinet: 'last_layer' (timm get_classifier(), else the last Linear: torchvision fc, "
        "Hugging Face classifier) or one Linear by name.")
    index_dim: int = option(
        8, "d: dimension of the epistemic index z ~ N(0, I_d) (the paper uses 8–30).")
    hidden: tuple[int, ...] = option(
        (64,), "Hidden widths of the learnable network σ_L and of the prior network σ_P (MLPs "
        "on [normalised φ, z] whose C·d outputs are contracted with z).")
    prior_scale: float = option(
        1.0, "α: scale of the fixed random prior network σ_P; its output has a std of about α "
        "logits per class at every input. It is what spreads the members off the data; the "
        "validation-tuned epinet_scale multiplies both σ_L and σ_P at prediction.")
    prior_seed: int = option(0, "Seed of the prior network's random weights (never trained).")
    samples: int = option(
        4, "Indices z drawn per training example (the base network runs once per batch).")
    predict_samples: int = option(
        20, "M: members = indices 0 … M−1 at prediction; member m's index is fixed by "
        "(seed, m), whatever M.")

    def validate(self) -> None:
        require(self.index_dim > 0, f"index_dim must be a positive integer, got {self.index_dim}")
        require(all(h > 0 for h in self.hidden),
                f"hidden widths must be positive integers, got {self.hidden!r}")
        require(self.prior_scale >= 0, f"prior_scale must be >= 0, got {self.prior_scale}")
        require(self.prior_seed >= 0, f"prior_seed must be >= 0, got {self.prior_seed}")
