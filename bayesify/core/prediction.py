"""``Prediction``: the mixture predictive and its uncertainty decomposition."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from bayesify import metrics

#: samples drawn from a Gaussian predictive for its uncertainty decomposition
GAUSSIAN_SAMPLES = 64


def gaussian_noise(num_classes: int) -> torch.Tensor:
    """``[S, 1, C]`` standard normal draws (seed 0) shared by every row and batch, so the
    decomposition of a Gaussian predictive is batch-independent and exportable."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn((GAUSSIAN_SAMPLES, 1, num_classes), generator=generator)


def gaussian_log_probs(mean: torch.Tensor, variance: torch.Tensor, link: str, *,
                       rowsum: torch.Tensor | None = None,
                       total: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, C]`` log predictive probabilities of ``N(mean, Σ)`` over the logits with the
    probit link (``diag Σ = variance``) or the Laplace bridge (also ``Σ 1``, ``1ᵀ Σ 1``)."""
    mean, var = mean.float(), variance.float().clamp_min(0)
    if link == "probit":
        return torch.log_softmax(mean / torch.sqrt(1.0 + math.pi / 8.0 * var), dim=-1)
    if link == "bridge":
        from bayesify.core.gaussian import bridge_log_probs

        return bridge_log_probs(mean, (var, rowsum, total)).float()
    raise ValueError(f"unknown link {link!r}; use 'probit' or 'bridge'")


@dataclass(frozen=True)
class Prediction:
    """Predictive distribution for a batch of B inputs: members or moments.

    Either ``member_logits [M, B, C]`` (M networks; mixture in probability space),
    or a Gaussian over the logits: ``mean [B, C]`` and ``variance [B, C]`` (its
    diagonal) with the ``link`` applied last — ``"probit"``:
    ``softmax(mean / sqrt(1 + π/8 · variance))``; ``"bridge"``: the Laplace bridge,
    which also reads ``rowsum [B, C]`` (Σ_f 1) and ``total [B]`` (1ᵀ Σ_f 1). For the
    Gaussian case ``member_logits`` are ``GAUSSIAN_SAMPLES`` fixed-seed draws from
    ``N(mean, diag variance)``: the aleatoric part is their expected entropy, and
    the epistemic part the total entropy of the link minus it (≥ 0).
    Use :meth:`scaled` for a temperature (it divides logits, not probabilities).
    """

    member_logits_: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    variance: torch.Tensor | None = None
    link: str = "members"
    rowsum: torch.Tensor | None = None
    total: torch.Tensor | None = None

    def __init__(self, member_logits: torch.Tensor | None = None, *,
                 mean: torch.Tensor | None = None, variance: torch.Tensor | None = None,
                 link: str | None = None, rowsum: torch.Tensor | None = None,
                 total: torch.Tensor | None = None) -> None:
        if (member_logits is None) == (mean is None):
            raise ValueError("a Prediction holds member_logits or (mean, variance), exactly one")
        if mean is not None and (variance is None or variance.shape != mean.shape):
            raise ValueError("a Gaussian Prediction needs variance [B, C] shaped like mean")
        link = link or ("members" if member_logits is not None else "probit")
        if link == "bridge" and (rowsum is None or total is None):
            raise ValueError("the 'bridge' link needs rowsum and total")
        for name, value in (("member_logits_", member_logits), ("mean", mean),
                            ("variance", variance), ("link", link), ("rowsum", rowsum),
                            ("total", total)):
            object.__setattr__(self, name, value)

    @property
    def is_gaussian(self) -> bool:
        return self.mean is not None

    def scaled(self, temperature: float | torch.Tensor) -> Prediction:
        """The predictive of the logits divided by ``temperature`` (a float, or a tensor
        to differentiate through)."""
        t = temperature
        if not isinstance(t, torch.Tensor):
            t = float(t)
            if t == 1.0:
                return self
        if not self.is_gaussian:
            return Prediction(self.member_logits_ / t)
        t2 = t * t
        return Prediction(mean=self.mean / t, variance=self.variance / t2, link=self.link,
                          rowsum=None if self.rowsum is None else self.rowsum / t2,
                          total=None if self.total is None else self.total / t2)

    @cached_property
    def member_logits(self) -> torch.Tensor:
        """``[M, B, C]``: the members, or fixed-seed samples of the Gaussian."""
        if not self.is_gaussian:
            return self.member_logits_
        z = gaussian_noise(self.mean.shape[-1]).to(self.mean.device)  # [S, 1, C]
        return self.mean.float() + self.variance.float().clamp_min(0).sqrt() * z

    @cached_property
    def log_probs(self) -> torch.Tensor:
        """``[B, C]`` log predictive probabilities (mixture mean, or the link)."""
        if not self.is_gaussian:
            return metrics.mixture_log_probs(self.member_logits_)
        return gaussian_log_probs(self.mean, self.variance, self.link, rowsum=self.rowsum,
                                  total=self.total)

    @cached_property
    def member_probs(self) -> torch.Tensor:
        """``[M, B, C]`` softmax of every member."""
        return self.member_logits.float().softmax(-1)

    @cached_property
    def probs(self) -> torch.Tensor:
        """``[B, C]`` mixture mean, averaged in probability space."""
        return self.log_probs.exp()

    @cached_property
    def entropy(self) -> torch.Tensor:
        """``[B]`` total predictive entropy H(E_m p_m)."""
        return metrics.entropy(self.probs)

    @cached_property
    def aleatoric(self) -> torch.Tensor:
        """``[B]`` expected entropy E_m H(p_m)."""
        return metrics.expected_entropy(self.member_probs)

    @cached_property
    def epistemic(self) -> torch.Tensor:
        """``[B]`` mutual information (BALD) = entropy − aleatoric."""
        return (self.entropy - self.aleatoric).clamp_min(0)

    @cached_property
    def variation_ratio(self) -> torch.Tensor:
        return metrics.variation_ratio(self.member_probs)

    @cached_property
    def predictive_variance(self) -> torch.Tensor:
        """``[B, C]`` variance of the class probabilities across members."""
        return self.member_probs.var(0, unbiased=False)

    @property
    def num_members(self) -> int:
        return self.member_logits.shape[0]

    def nll(self, labels: torch.Tensor) -> torch.Tensor:
        """``[B]`` negative log predictive probability of ``labels``."""
        return metrics.per_example_nll(self.log_probs, labels)

    @staticmethod
    def cat(parts: list[Prediction]) -> Prediction:
        """Concatenate predictions of consecutive batches along B."""
        first = parts[0]
        if not first.is_gaussian:
            return Prediction(torch.cat([p.member_logits_ for p in parts], dim=1))
        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)
        return Prediction(mean=cat("mean"), variance=cat("variance"), link=first.link,
                          rowsum=cat("rowsum"), total=cat("total"))

    def rows(self, index: torch.Tensor | slice) -> Prediction:
        """The predictions of the examples ``index`` (along B)."""
        if not self.is_gaussian:
            return Prediction(self.member_logits_[:, index])
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]
        return Prediction(mean=pick(self.mean), variance=pick(self.variance), link=self.link,
                          rowsum=pick(self.rowsum), total=pick(self.total))

    def to(self, device: torch.device | str) -> Prediction:
        if not self.is_gaussian:
            return Prediction(self.member_logits_.to(device))
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        return Prediction(mean=move(self.mean), variance=move(self.variance), link=self.link,
                          rowsum=move(self.rowsum), total=move(self.total))

    def argmax(self) -> torch.Tensor:
        return self.probs.argmax(-1)
