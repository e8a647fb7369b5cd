"""Weight priors of the weight-space families and their densities / KLs.

Four priors, per weight (Blundell et al. 2015, §3.3, plus a relative one):

* ``relative`` (default): ``p(w) = N(w; w₀, (σ·max(|w₀|, floor))²)``, centred on the
  pretrained weight w₀ with a std relative to it (σ is a fraction, e.g. 0.1);
* ``gaussian``:       ``p(w) = N(w; 0, σ²)``
* ``pretrained``:     ``p(w) = N(w; w₀, σ²)``, centred on the pretrained weight w₀
* ``scale_mixture``:  ``p(w) = π N(w; 0, σ₁²) + (1 − π) N(w; 0, σ₂²)``

Why ``relative`` is the default: fine-tuning sets are small, so KL/N_train weighs
heavily and the posterior ends near the prior. An absolute prior such as N(0, 1)
around pretrained weights of size ~0.05 then pulls every weight's std towards 1
(a KL of 10⁴–10⁷ nats against an NLL below 1) and destroys the network; a prior
whose spread is relative to the weights it perturbs is safe on any network, and
with σ equal to the initial relative std (meanfield's δ) the KL starts at the
mean-only term.

The Gaussian priors have a closed-form ``KL(q‖p)`` against a Gaussian q;
the mixture has none, so its KL is estimated by one Monte-Carlo sample
``log q(w) − log p(w)``, ``w ~ q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bayesify.core.config import MethodConfig, option, require

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
PRIORS = ("relative", "gaussian", "pretrained", "scale_mixture")



def gaussian_log_prob(w: torch.Tensor, mean: torch.Tensor | float, std: torch.Tensor | float) -> torch.Tensor:
    """Elementwise ``log N(w; mean, std²)``."""
    std_t = torch.as_tensor(std, dtype=w.dtype, device=w.device)
    return -0.5 * ((w - mean) / std_t) ** 2 - torch.log(std_t) - _LOG_SQRT_2PI


def gaussian_kl(
    mu_q: torch.Tensor, std_q: torch.Tensor, mu_p: torch.Tensor | float,
    std_p: torch.Tensor | float,
) -> torch.Tensor:
    """Elementwise ``KL(N(μq, σq²) ‖ N(μp, σp²)) = log σp/σq + (σq² + (μq−μp)²)/(2σp²) − ½``
    (σp a float or a tensor broadcastable against μq; σq floored at the dtype's tiny)."""
    std_p_t = torch.as_tensor(std_p, dtype=std_q.dtype, device=std_q.device)
    std_q = std_q.clamp_min(torch.finfo(std_q.dtype).tiny)
    return (torch.log(std_p_t) - torch.log(std_q)
            + (std_q**2 + (mu_q - mu_p) ** 2) / (2.0 * std_p_t**2) - 0.5)


def scale_mixture_log_prob(w: torch.Tensor, pi: float, std1: float, std2: float) -> torch.Tensor:
    """Elementwise ``log(π N(w; 0, σ₁²) + (1−π) N(w; 0, σ₂²))`` via logsumexp (stable)."""
    parts = []
    if pi > 0:
        parts.append(math.log(pi) + gaussian_log_prob(w, 0.0, std1))
    if pi < 1:
        parts.append(math.log1p(-pi) + gaussian_log_prob(w, 0.0, std2))
    return torch.logsumexp(torch.stack(parts), dim=0)


@dataclass(frozen=True)
class WeightPrior:
    """One of :data:`PRIORS` with its hyper-parameters."""

    kind: str = "relative"
    std: float = 0.1
    pi: float = 0.5
    std1: float = 1.0
    std2: float = math.exp(-6)
    floor: float = 1e-3

    @classmethod
    def from_config(cls, config) -> WeightPrior:
        return cls(kind=config.prior, std=config.prior_std, pi=config.mixture_pi,
                   std1=config.mixture_std1, std2=config.mixture_std2,
                   floor=float(getattr(config, "init_floor", 1e-3)))

    @property
    def analytic(self) -> bool:
        return self.kind in ("relative", "gaussian", "pretrained")

    def centre(self, pretrained: torch.Tensor) -> torch.Tensor | float:
        return pretrained if self.kind in ("pretrained", "relative") else 0.0

    def scale(self, pretrained: torch.Tensor) -> torch.Tensor | float:
        """Prior std per weight: ``σ·max(|w₀|, floor)`` for ``relative``, else ``σ``."""
        if self.kind == "relative":
            return self.std * pretrained.abs().clamp_min(self.floor)
        return self.std

    def log_prob(self, w: torch.Tensor, pretrained: torch.Tensor) -> torch.Tensor:
        """Elementwise ``log p(w)``; ``pretrained`` is w₀ (same shape as ``w`` or broadcastable)."""
        if self.kind == "scale_mixture":
            return scale_mixture_log_prob(w, self.pi, self.std1, self.std2)
        return gaussian_log_prob(w, self.centre(pretrained), self.scale(pretrained))

    def kl(self, mu: torch.Tensor, std: torch.Tensor, pretrained: torch.Tensor) -> torch.Tensor:
        """``KL(N(μ, σ²) ‖ p)`` summed over all weights (analytic, or 1-sample MC)."""
        if self.analytic:
            return gaussian_kl(mu, std, self.centre(pretrained), self.scale(pretrained)).sum()
        w = mu + std * torch.randn_like(mu)
        return (gaussian_log_prob(w, mu, std) - self.log_prob(w, pretrained)).sum()

    def sample(self, m: int, pretrained: torch.Tensor) -> torch.Tensor:
        """``[m, *pretrained.shape]`` fresh samples from the prior."""
        shape = (m, *pretrained.shape)
        eps = torch.randn(shape, device=pretrained.device, dtype=pretrained.dtype)
        if self.kind == "scale_mixture":
            wide = torch.rand(shape, device=pretrained.device) < self.pi
            scale = torch.where(wide, self.std1, self.std2).to(pretrained.dtype)
            return eps * scale
        return self.centre(pretrained) + self.scale(pretrained) * eps


@dataclass(frozen=True)
class WeightPriorConfig(MethodConfig):
    """Prior fields shared by the weight-space families (meanfield, hypernet)."""

    prior: str = option(
        "relative",
        "Weight prior: 'relative' N(w₀, (σ·max(|w₀|, floor))²) centred on the pretrained weights "
        "with a std relative to them (default: safe on any network, since with a small "
        "fine-tuning set the posterior ends near the prior), 'gaussian' N(0, σ²), 'pretrained' "
        "N(w₀, σ²), or 'scale_mixture' π N(0, σ₁²) + (1−π) N(0, σ₂²) per weight.",
    )
    prior_std: float = option(
        0.1, "σ of the prior: a fraction of |w₀| for 'relative' (0.1 = the initial relative "
        "posterior std, so the KL starts at its mean-only term), absolute for 'gaussian' and "
        "'pretrained'.")
    mixture_pi: float = option(0.5, "π of the scale-mixture prior.")
    mixture_std1: float = option(1.0, "σ₁ (wide component) of the scale-mixture prior.")
    mixture_std2: float = option(math.exp(-6), "σ₂ (narrow component) of the scale-mixture prior.")

    def validate(self) -> None:
        require(self.prior in PRIORS, f"prior must be one of {PRIORS}, got {self.prior!r}")
        require(self.prior_std > 0, f"prior_std must be > 0, got {self.prior_std}")
        require(0.0 <= self.mixture_pi <= 1.0, f"mixture_pi must be in [0, 1], got {self.mixture_pi}")
        require(self.mixture_std1 > 0 and self.mixture_std2 > 0,
                f"mixture stds must be > 0, got {self.mixture_std1}, {self.mixture_std2}")
