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


def temper(log_probs: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``[B, C]`` ``log softmax(log p̄ / T)``: the predictive-level temperature
    ``p_T(y|x) ∝ p̄(y|x)^(1/T)`` (T < 1 sharpens, T > 1 softens; T = 1 is the identity)."""
    if not isinstance(temperature, torch.Tensor) and float(temperature) == 1.0:
        return log_probs
    return torch.log_softmax(log_probs / temperature, dim=-1)


def decomposition(tempered_total: torch.Tensor, total: torch.Tensor,
                  aleatoric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aleatoric_T, epistemic_T)`` ``[B]`` after a predictive-level temperature.

    The rule: the temperature calibrates the *total*, the posterior decides the *split*.
    The untempered decomposition ``H(p̄) = E_m H(p_m) + MI`` is rescaled by
    ``H(p_T) / H(p̄)``, so both parts stay ≥ 0, they sum to the tempered entropy
    ``H(p_T)``, and T = 1 gives the untempered decomposition exactly (where
    ``H(p̄) = 0`` the epistemic part is 0 and the aleatoric part is ``H(p_T)``)."""
    mi = (total - aleatoric).clamp_min(0)
    mi = torch.minimum(mi, total)
    ratio = torch.where(total > 0, tempered_total / total.clamp_min(1e-30),
                        torch.zeros_like(total))
    epistemic = mi * ratio
    return (tempered_total - epistemic).clamp_min(0), epistemic


def gaussian_expected_entropy(mean: torch.Tensor, variance: torch.Tensor,
                              noise: torch.Tensor | None = None) -> torch.Tensor:
    """``[B]`` expected entropy ``E_m E_z H(softmax(f_m + √v_m · z))`` of a mixture of
    Gaussians over the logits (``mean`` / ``variance [M, B, C]``), over the fixed draws of
    :func:`gaussian_noise` (``noise [S, 1, C]``: the same draws, e.g. an exported module's
    buffer) — the aleatoric part of a mixture whose members carry a posterior spread of their
    own (member-wise Laplace heads), and of one Gaussian (``M = 1``). One member at a time in
    memory."""
    z = gaussian_noise(mean.shape[-1]).to(mean.device) if noise is None else noise
    total = None
    for m, v in zip(mean.float(), variance.float()):
        part = metrics.expected_entropy((m + v.clamp_min(0).sqrt() * z).softmax(-1))
        total = part if total is None else total + part
    return total / mean.shape[0]


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
    the epistemic part the total entropy of the link minus it (≥ 0). A members prediction
    whose members carry a posterior spread of their own (each a Gaussian over the logits
    through its link: member-wise Laplace heads) passes that spread's expected entropy as
    ``member_aleatoric [B]`` (:func:`gaussian_expected_entropy`), so the within-member
    spread counts as epistemic, as the Gaussian case's does.
    **Temperature** (:meth:`scaled`): one temperature on the *predictive's
    log-probabilities*, ``p_T = softmax(log p̄ / T)`` (:func:`temper`), for every family —
    ``log p̄`` is the member mixture or the link's output. The members (``member_logits``,
    ``member_probs``, ``variation_ratio``, ``predictive_variance``) are the posterior's and
    stay untempered; ``entropy`` is the tempered predictive's, and ``aleatoric`` /
    ``epistemic`` split it in the untempered decomposition's proportions
    (:func:`decomposition`).
    """

    member_logits_: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    variance: torch.Tensor | None = None
    link: str = "members"
    rowsum: torch.Tensor | None = None
    total: torch.Tensor | None = None
    temperature: float | torch.Tensor = 1.0
    member_aleatoric: torch.Tensor | None = None

    def __init__(self, member_logits: torch.Tensor | None = None, *,
                 mean: torch.Tensor | None = None, variance: torch.Tensor | None = None,
                 link: str | None = None, rowsum: torch.Tensor | None = None,
                 total: torch.Tensor | None = None,
                 temperature: float | torch.Tensor = 1.0,
                 member_aleatoric: torch.Tensor | None = None) -> None:
        if (member_logits is None) == (mean is None):
            raise ValueError("a Prediction holds member_logits or (mean, variance), exactly one")
        if member_aleatoric is not None and (
                member_logits is None or member_aleatoric.shape != member_logits.shape[1:2]):
            raise ValueError("member_aleatoric [B] belongs to a members Prediction [M, B, C]")
        if mean is not None and (variance is None or variance.shape != mean.shape):
            raise ValueError("a Gaussian Prediction needs variance [B, C] shaped like mean")
        link = link or ("members" if member_logits is not None else "probit")
        if link == "bridge" and (rowsum is None or total is None):
            raise ValueError("the 'bridge' link needs rowsum and total")
        for name, value in (("member_logits_", member_logits), ("mean", mean),
                            ("variance", variance), ("link", link), ("rowsum", rowsum),
                            ("total", total), ("temperature", temperature),
                            ("member_aleatoric", member_aleatoric)):
            object.__setattr__(self, name, value)

    @property
    def is_gaussian(self) -> bool:
        return self.mean is not None

    def scaled(self, temperature: float | torch.Tensor) -> Prediction:
        """The predictive tempered by ``temperature`` (a float, or a tensor to differentiate
        through): ``softmax(log p̄ / T)`` on the predictive's log-probabilities, never on
        the members' logits or the Gaussian's moments. Temperatures compose by product."""
        t = temperature
        if not isinstance(t, torch.Tensor):
            t = float(t)
            if t == 1.0:
                return self
        return self._shared(self._with(temperature=self.temperature * t))

    @property
    def untempered(self) -> Prediction:
        """The same predictive at temperature 1."""
        return self._shared(self._with(temperature=1.0))

    def _shared(self, other: Prediction) -> Prediction:
        """``other`` (same data, another temperature) reusing what does not depend on it."""
        for name in ("raw_log_probs", "member_logits", "member_probs"):
            if name in self.__dict__:
                other.__dict__[name] = self.__dict__[name]
        return other

    def _with(self, **changes: object) -> Prediction:
        fields = {"mean": self.mean, "variance": self.variance, "link": self.link,
                  "rowsum": self.rowsum, "total": self.total, "temperature": self.temperature}
        fields.update(changes)
        if not self.is_gaussian:
            return Prediction(self.member_logits_, temperature=fields["temperature"],
                              member_aleatoric=self.member_aleatoric)
        return Prediction(**fields)

    @cached_property
    def member_logits(self) -> torch.Tensor:
        """``[M, B, C]``: the members, or fixed-seed samples of the Gaussian."""
        if not self.is_gaussian:
            return self.member_logits_
        z = gaussian_noise(self.mean.shape[-1]).to(self.mean.device)  # [S, 1, C]
        return self.mean.float() + self.variance.float().clamp_min(0).sqrt() * z

    @cached_property
    def raw_log_probs(self) -> torch.Tensor:
        """``[B, C]`` untempered log predictive probabilities ``log p̄`` (mixture mean, or
        the link)."""
        if not self.is_gaussian:
            return metrics.mixture_log_probs(self.member_logits_)
        return gaussian_log_probs(self.mean, self.variance, self.link, rowsum=self.rowsum,
                                  total=self.total)

    @cached_property
    def log_probs(self) -> torch.Tensor:
        """``[B, C]`` log predictive probabilities at the temperature:
        ``log softmax(log p̄ / T)``."""
        return temper(self.raw_log_probs, self.temperature)

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
        """``[B]`` total predictive entropy H(p_T) (at T = 1: H(E_m p_m))."""
        return metrics.entropy(self.probs)

    @cached_property
    def _split(self) -> tuple[torch.Tensor, torch.Tensor]:
        raw_total = metrics.entropy(self.raw_log_probs.exp())
        raw_aleatoric = (self.member_aleatoric if self.member_aleatoric is not None
                         else metrics.expected_entropy(self.member_probs))
        if not isinstance(self.temperature, torch.Tensor) and float(self.temperature) == 1.0:
            return raw_aleatoric, (raw_total - raw_aleatoric).clamp_min(0)
        return decomposition(self.entropy, raw_total, raw_aleatoric)

    @cached_property
    def aleatoric(self) -> torch.Tensor:
        """``[B]`` expected entropy E_m H(p_m) (tempered: see :func:`decomposition`)."""
        return self._split[0]

    @cached_property
    def epistemic(self) -> torch.Tensor:
        """``[B]`` mutual information (BALD) = entropy − aleatoric (tempered: see
        :func:`decomposition`)."""
        return self._split[1]

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
        if any(float(p.temperature) != float(first.temperature) for p in parts):
            raise ValueError("Prediction.cat needs parts at one temperature")
        if not first.is_gaussian:
            spread = [p.member_aleatoric for p in parts]
            if any(a is None for a in spread) and any(a is not None for a in spread):
                raise ValueError("Prediction.cat needs parts that all carry member_aleatoric "
                                 "or none")
            return Prediction(torch.cat([p.member_logits_ for p in parts], dim=1),
                              temperature=first.temperature,
                              member_aleatoric=None if spread[0] is None else torch.cat(spread))
        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)
        return Prediction(mean=cat("mean"), variance=cat("variance"), link=first.link,
                          rowsum=cat("rowsum"), total=cat("total"),
                          temperature=first.temperature)

    def rows(self, index: torch.Tensor | slice) -> Prediction:
        """The predictions of the examples ``index`` (along B)."""
        if not self.is_gaussian:
            spread = self.member_aleatoric
            return Prediction(self.member_logits_[:, index], temperature=self.temperature,
                              member_aleatoric=None if spread is None else spread[index])
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]
        return self._with(mean=pick(self.mean), variance=pick(self.variance),
                          rowsum=pick(self.rowsum), total=pick(self.total))

    def to(self, device: torch.device | str) -> Prediction:
        if not self.is_gaussian:
            spread = self.member_aleatoric
            return Prediction(self.member_logits_.to(device), temperature=self.temperature,
                              member_aleatoric=None if spread is None else spread.to(device))
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        return self._with(mean=move(self.mean), variance=move(self.variance),
                          rowsum=move(self.rowsum), total=move(self.total))

    def argmax(self) -> torch.Tensor:
        return self.probs.argmax(-1)
