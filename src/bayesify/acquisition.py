"""Acquisition functions for pool-based deep Bayesian active learning.

Every score maps the member probabilities of a pool, ``member_probs [M, N, C]``
(M posterior members, N pool points, C classes), to one score per point ``[N]``;
larger means "label this one first". Natural logarithms throughout.

- :func:`bald`: mutual information I(y; w | x) = H(E_m p_m) − E_m H(p_m)
  (Houlsby et al. 2011; Gal, Islam & Ghahramani 2017).
- :func:`max_entropy`: predictive entropy H(E_m p_m).
- :func:`variation_ratio`: 1 − (members voting for the modal class) / M.
- :func:`mean_std`: (1/C) Σ_c sqrt(E_m[p_mc²] − (E_m p_mc)²) (Kendall et al.; Gal et al.).
- :func:`random`: i.i.d. uniform scores (the baseline).

With a single member (a MAP network) BALD, variation ratio and mean std are all
identically 0 — the model has no epistemic spread to measure — so MAP active
learning has to use :func:`max_entropy`.

:func:`select` ranks a pool held by any :class:`~bayesify.predict.BasePredictor`
and returns the indices to label: the top-k of a score, or with
``batch_aware=True`` the greedy BatchBALD batch (Kirsch, van Amersfoort & Gal 2019),
see :func:`batch_bald`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from bayesify import metrics
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.predict.predictor import BasePredictor

ScoreFn = Callable[..., torch.Tensor]


def _check(member_probs: torch.Tensor) -> torch.Tensor:
    if member_probs.dim() != 3:
        raise BayesifyError(
            f"member_probs must have shape [M, N, C], got {tuple(member_probs.shape)}; "
            "add a leading member axis of size 1 for a single network"
        )
    return member_probs.float()


def bald(member_probs: torch.Tensor) -> torch.Tensor:
    """``[M, N, C]`` → ``[N]`` mutual information H(E_m p_m) − E_m H(p_m) ≥ 0.

    Zero when all members agree; at most min(log C, log M), reached when the
    members put all their mass on distinct classes spread evenly over C.
    """
    return metrics.mutual_information(_check(member_probs))


def max_entropy(member_probs: torch.Tensor) -> torch.Tensor:
    """``[M, N, C]`` → ``[N]`` predictive entropy H(p̄) of the mixture p̄ = E_m p_m."""
    return metrics.entropy(_check(member_probs).mean(0))


def variation_ratio(member_probs: torch.Tensor) -> torch.Tensor:
    """``[M, N, C]`` → ``[N]`` 1 − (votes for the modal class)/M, votes = member argmaxes."""
    return metrics.variation_ratio(_check(member_probs))


def mean_std(member_probs: torch.Tensor) -> torch.Tensor:
    """``[M, N, C]`` → ``[N]`` mean over classes of the std of p_mc across members.

    σ(x) = (1/C) Σ_c sqrt(E_m[p_mc²] − (E_m p_mc)²) (population std, 1/M).
    """
    probs = _check(member_probs)
    return probs.var(0, unbiased=False).clamp_min(0).sqrt().mean(-1)


def random(member_probs: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[M, N, C]`` → ``[N]`` i.i.d. U(0, 1) scores: top-k = a uniform random k-subset."""
    n = _check(member_probs).shape[1]
    return torch.rand(n, generator=generator)


SCORES: dict[str, ScoreFn] = {
    "bald": bald,
    "max_entropy": max_entropy,
    "variation_ratio": variation_ratio,
    "mean_std": mean_std,
    "random": random,
}


def get_score(score: str | ScoreFn) -> ScoreFn:
    """Resolve a score name (``SCORES``) or pass a callable through."""
    if callable(score):
        return score
    if score not in SCORES:
        raise BayesifyError(f"unknown acquisition score {score!r}; available: {', '.join(SCORES)}")
    return SCORES[score]


def score_pool(
    member_probs: torch.Tensor, score: str | ScoreFn = "bald", *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[M, N, C]`` → ``[N]`` scores of ``score`` (name or callable)."""
    fn = get_score(score)
    if fn is random:
        return random(member_probs, generator=generator)
    return fn(member_probs)


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[k]`` of the k largest scores, best first (ties: lowest index first)."""
    if not 0 < k <= scores.numel():
        raise BayesifyError(f"k must be in 1..{scores.numel()} (the pool size), got {k}")
    # a stable descending sort keeps ties in pool order, so the result is deterministic
    return torch.sort(scores, descending=True, stable=True).indices[:k]


def _joint_entropy(configs: torch.Tensor, probs_mnc: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """H(y_A, y_x) for every candidate x, ``[N]``.

    ``configs [S, M]``: p(ŷ_A^s | w_m) for S configurations of the selected labels.
    ``weights [S]``: 1 for an exhaustive enumeration, 1/(S·p(ŷ_A^s)) for samples drawn
    from p(y_A) (importance weights turning Σ_s into E_{p(y_A)}).
    ``probs_mnc [M, N, C]``: p(y_x | w_m).

    p(ŷ_A^s, y_x) = (1/M) Σ_m p(ŷ_A^s|w_m) p(y_x|w_m);
    H = −Σ_s weights_s Σ_y p(ŷ_A^s, y) log p(ŷ_A^s, y).
    """
    m, n, _ = probs_mnc.shape
    out = torch.empty(n, dtype=probs_mnc.dtype)
    # chunk over candidates so the [N, S, C] joint stays a few MB
    step = max(1, 2_000_000 // max(1, configs.shape[0] * probs_mnc.shape[-1]))
    for lo in range(0, n, step):
        joint = torch.einsum("sm,mnc->nsc", configs, probs_mnc[:, lo:lo + step]) / m
        plogp = joint * joint.clamp_min(1e-300).log()
        out[lo:lo + step] = -(plogp.sum(-1) * weights).sum(-1)
    return out


def batch_bald(
    member_probs: torch.Tensor,
    k: int,
    *,
    num_samples: int = 1000,
    max_configs: int = 1000,
    candidates: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Greedy BatchBALD: indices ``[k]`` maximising I(y_1..y_k; w) one point at a time.

    ``member_probs [M, N, C]``. Step n adds the candidate x maximising
    I(y_A, y_x; w) = H(y_A, y_x) − Σ_{i∈A∪{x}} E_m H(y_i | w_m), where A are the n−1
    points already chosen and the joint predictive is the member mixture
    p(y_A, y_x) = (1/M) Σ_m Π_{i∈A∪{x}} p(y_i | w_m) (labels independent given w).
    Because I is submodular, a duplicate of a chosen point gains ≈ nothing and is
    passed over, unlike top-k BALD.

    H(y_A, y_x) is summed exactly over all C^|A| label configurations of A while
    that is at most ``max_configs``; beyond it, ``num_samples`` configurations are
    drawn from p(y_A) by ancestral sampling (a member index m_s ~ U{1..M} per sample,
    then ŷ_i ~ p(y_i | w_{m_s}), reused as A grows) and H is the importance-weighted
    Monte-Carlo estimate
    H ≈ −(1/S) Σ_s Σ_y [p(ŷ_A^s, y)/p(ŷ_A^s)] log p(ŷ_A^s, y), unbiased because the
    inner sum over y and both probabilities are exact given the members; all candidates
    share the same samples, so their comparison is not blurred by sampling noise.
    Cost per step: O(N · S · M · C). ``candidates`` restricts the search to the top-BALD
    points (the first pick is always the top-BALD point).
    """
    probs = _check(member_probs).double()
    m, n, _ = probs.shape
    if not 0 < k <= n:
        raise BayesifyError(f"k must be in 1..{n} (the pool size), got {k}")
    if num_samples <= 0 or max_configs <= 0:
        raise BayesifyError(
            f"num_samples and max_configs must be positive, got {num_samples}, {max_configs}"
        )
    pool = torch.arange(n)
    if candidates is not None and candidates < n:
        pool = top_k(bald(member_probs), max(candidates, k))
    probs_pool = probs[:, pool]  # [M, P, C]
    cond_entropy = metrics.expected_entropy(probs_pool)  # [P]  E_m H(y_x | w_m)
    chosen: list[int] = []  # positions into `pool`
    available = torch.ones(pool.numel(), dtype=torch.bool)
    # sampled-mode state: one member index per sample and the labels drawn so far
    sample_members = torch.randint(m, (num_samples,), generator=generator)
    sampled_labels: list[torch.Tensor] = []
    for _ in range(k):
        configs, weights = _configurations(
            probs_pool, chosen, sample_members, sampled_labels, max_configs, generator
        )
        gain = _joint_entropy(configs, probs_pool, weights) - cond_entropy
        gain = gain - cond_entropy[chosen].sum()
        gain[~available] = -math.inf
        best = int(gain.argmax())
        chosen.append(best)
        available[best] = False
    return pool[torch.tensor(chosen, dtype=torch.long)]


def _configurations(
    probs_pool: torch.Tensor,
    chosen: list[int],
    sample_members: torch.Tensor,
    sampled_labels: list[torch.Tensor],
    max_configs: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(configs [S, M], weights [S])`` for the labels of the chosen points (see ``batch_bald``)."""
    m, _, c = probs_pool.shape
    dtype = probs_pool.dtype
    if not chosen:
        return torch.ones(1, m, dtype=dtype), torch.ones(1, dtype=dtype)
    if c ** len(chosen) <= max_configs:
        labels = torch.tensor(list(itertools.product(range(c), repeat=len(chosen))))  # [S, |A|]
        configs = torch.ones(labels.shape[0], m, dtype=dtype)
        for j, i in enumerate(chosen):
            configs = configs * probs_pool[:, i, labels[:, j]].T  # p(ŷ_i | w_m), [S, M]
        return configs, torch.ones(labels.shape[0], dtype=dtype)
    # ancestral samples: extend every sample's label list to the chosen points it lacks
    while len(sampled_labels) < len(chosen):
        i = chosen[len(sampled_labels)]
        p = probs_pool[sample_members, i]  # [S, C]: p(y_i | w_{m_s})
        sampled_labels.append(torch.multinomial(p.float(), 1, generator=generator).squeeze(-1))
    configs = torch.ones(sample_members.numel(), m, dtype=dtype)
    for i, labels in zip(chosen, sampled_labels):
        configs = configs * probs_pool[:, i, labels].T
    marginal = configs.mean(-1)  # p(ŷ_A^s) = (1/M) Σ_m p(ŷ_A^s | w_m)
    weights = 1.0 / (marginal.clamp_min(1e-300) * sample_members.numel())
    return configs, weights


def collect_member_probs(predictor: BasePredictor, loader: Iterable) -> torch.Tensor:
    """``[M, N, C]`` softmax of the predictor's member logits: the posterior's members
    (the predictor's temperature acts on the predictive, not on them)."""
    logits, _ = predictor.collect(loader)
    return logits.float().softmax(-1)


def select(
    predictor: BasePredictor,
    pool_loader: Iterable,
    k: int,
    *,
    score: str | ScoreFn = "bald",
    batch_aware: bool = False,
    generator: torch.Generator | None = None,
    num_samples: int = 1000,
    max_configs: int = 1000,
    candidates: int | None = None,
) -> torch.Tensor:
    """Indices ``[k]`` (positions in the order ``pool_loader`` yields) of the points to label.

    ``predictor``: any :class:`~bayesify.predict.BasePredictor` (``bnn.predictor()``, or
    ``ModelPredictor(net)`` / ``ModelPredictor([nets])``); its members' probabilities
    ``[M, N, C]`` over the pool are scored by ``score`` (a name in ``SCORES`` or a
    callable ``[M, N, C] → [N]``) and the top-k returned, best first.
    ``batch_aware=True`` (``score="bald"`` only) returns the greedy BatchBALD batch
    (:func:`batch_bald` with ``num_samples``, ``max_configs``, ``candidates``).
    ``generator`` seeds the random score and the BatchBALD configuration samples.
    The pool loader must not shuffle, or the indices mean nothing.
    """
    member_probs = collect_member_probs(predictor, pool_loader)
    if batch_aware:
        if get_score(score) is not bald:
            raise BayesifyError(
                f"batch_aware=True is BatchBALD and needs score='bald', got {score!r}; "
                "use batch_aware=False for top-k of other scores"
            )
        return batch_bald(member_probs, k, num_samples=num_samples, max_configs=max_configs,
                          candidates=candidates, generator=generator)
    return top_k(score_pool(member_probs, score, generator=generator), k)


__all__ = [
    "SCORES",
    "bald",
    "batch_bald",
    "collect_member_probs",
    "get_score",
    "max_entropy",
    "mean_std",
    "random",
    "score_pool",
    "select",
    "top_k",
    "variation_ratio",
]
