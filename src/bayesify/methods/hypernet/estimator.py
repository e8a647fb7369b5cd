"""Nearest-neighbour KL estimator of Bayes by Hypernet (Pawlowski et al. 2017, eq. 2).

For n samples ``w_q`` of the implicit posterior and m samples ``w_p`` of the
prior (Wang, Kulkarni & Verdú 2009; Kozachenko–Leonenko)::

    KL(q‖p) ≈ d/n Σ_i log(ν_i / ρ_i) + log(m / (n − 1))

``ν_i = min_j |w_q^i − w_p^j|`` (nearest prior sample), ``ρ_i = min_{j≠i}
|w_q^i − w_q^j|`` (nearest other posterior sample). Bayes by Hypernet treats
every weight independently (d = 1) and sums the per-weight estimates. In 1-D
both nearest neighbours come from sorting, so the cost is O((n + m) log(n + m))
per weight and memory O((n + m)·P) — no ``[n, m, P]`` distance tensor.
"""

from __future__ import annotations

import math

import torch

from bayesify.errors import BayesifyError

#: floor on distances: two bit-identical samples give log(0) otherwise
_DIST_FLOOR = 1e-20


def nearest_neighbour_kl(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-variable 1-D nearest-neighbour estimate of ``KL(q‖p)``.

    ``q [n, P]``: n posterior samples of P variables (differentiable);
    ``p [m, P]``: m prior samples (no gradient needed). Returns ``[P]``;
    ``.sum()`` it for the KL of independent weights. Needs n ≥ 2, m ≥ 1.
    """
    n, m = q.shape[0], p.shape[0]
    if q.dim() != 2 or p.dim() != 2 or q.shape[1] != p.shape[1]:
        raise BayesifyError(f"expected q [n, P] and p [m, P], got {tuple(q.shape)} and {tuple(p.shape)}")
    if n < 2 or m < 1:
        raise BayesifyError(f"the nearest-neighbour KL needs n >= 2 posterior and m >= 1 prior "
                            f"samples, got n={n}, m={m}")
    q_sorted = q.sort(dim=0).values  # sort is differentiable in the values
    gaps = q_sorted[1:] - q_sorted[:-1]  # [n-1, P], >= 0
    inf = torch.full_like(gaps[:1], float("inf"))
    rho = torch.minimum(torch.cat([inf, gaps]), torch.cat([gaps, inf]))  # [n, P]

    prior_rows = p.detach().to(q.dtype).sort(dim=0).values.t().contiguous()  # [P, m]
    values = q_sorted.t().contiguous()  # [P, n]
    upper = torch.searchsorted(prior_rows, values.detach())  # first prior sample >= q
    lower = (upper - 1).clamp(0, m - 1)
    upper = upper.clamp(max=m - 1)
    nu = torch.minimum((values - prior_rows.gather(1, lower)).abs(),
                       (values - prior_rows.gather(1, upper)).abs())  # [P, n]

    log_ratio = nu.clamp_min(_DIST_FLOOR).log() - rho.t().clamp_min(_DIST_FLOOR).log()
    return log_ratio.mean(dim=1) + math.log(m / (n - 1))
