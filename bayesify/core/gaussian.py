"""Small Gaussian helpers shared by the variational families."""

from __future__ import annotations

import math

import torch


def inverse_softplus(value: torch.Tensor, *, floor: float = 1e-30) -> torch.Tensor:
    """ρ with ``softplus(ρ) = value`` (values below ``floor`` are floored).

    ``log(expm1(v))`` written as ``v + log(−expm1(−v))`` so that it neither
    overflows for large v nor loses small v.
    """
    value = value.clamp_min(floor)
    return value + torch.log(-torch.expm1(-value))


def gaussian_kl(mu_q: torch.Tensor, var_q: torch.Tensor, mu_p: float, std_p: float) -> torch.Tensor:
    """Elementwise KL(N(μq, σq²) ‖ N(μp, σp²)) from the *variance* σq² of q.

    σq² is floored at the smallest normal number of its dtype: a std that
    underflowed to 0 (softplus(ρ) for ρ ≲ −100 in fp32) would otherwise give
    ``KL = inf`` and a NaN step instead of a large finite penalty.
    """
    var_p = std_p**2
    log_var_q = torch.log(var_q.clamp_min(torch.finfo(var_q.dtype).tiny))
    return 0.5 * (math.log(var_p) - log_var_q + (var_q + (mu_q - mu_p) ** 2) / var_p - 1.0)


def probit_log_probs(logits: torch.Tensor, var_diag: torch.Tensor) -> torch.Tensor:
    """``log softmax(f / sqrt(1 + π/8 · diag Σ_f))`` ``[B, C]``."""
    return torch.log_softmax(logits / torch.sqrt(1.0 + math.pi / 8.0 * var_diag), dim=-1)


def bridge_log_probs(logits: torch.Tensor, fvar: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Laplace bridge (Hobbhahn et al.) as in laplace-torch: log of the Dirichlet mean α/Σα.

    Zero-mean correction with ``Σ_f 1`` and ``1ᵀ Σ_f 1`` only (no ``[B, C, C]``)::

        μ = f − (Σ_f 1)(1ᵀ f)/(1ᵀ Σ_f 1),   v = diag Σ_f − (Σ_f 1)²/(1ᵀ Σ_f 1)
        α_c = (1 − 2/C + e^{μ_c} Σ_l e^{−μ_l} / C²) / v_c
    """
    diag, rowsum, total = fvar
    dtype = logits.dtype
    f, diag, rowsum, total = (t.double() for t in (logits, diag, rowsum, total))
    c = f.shape[-1]
    mu = f - rowsum * f.sum(-1, keepdim=True) / total.unsqueeze(-1)
    var = diag - rowsum.square() / total.unsqueeze(-1)
    cross = torch.exp(mu + torch.logsumexp(-mu, dim=-1, keepdim=True))
    alpha = (1 - 2 / c + cross / c**2) / var
    probs = torch.nan_to_num(alpha / alpha.sum(-1, keepdim=True), nan=1.0 / c)
    return probs.clamp_min(torch.finfo(torch.float64).tiny).log().to(dtype)
