"""Small Gaussian helpers shared by the variational families (parameterisation and KL)."""

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
