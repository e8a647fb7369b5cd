"""Evaluation metrics as plain functions on tensors.

Conventions: ``probs [N, C]`` (mixture mean), ``member_probs [M, N, C]``,
``member_logits [M, N, C]``, ``labels [N]`` (long). Natural logarithms.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-12


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    return (probs.argmax(-1) == labels).float().mean().item()


def mixture_log_probs(member_logits: torch.Tensor) -> torch.Tensor:
    """``[N, C]`` log of the mixture mean: logsumexp_m log softmax − log M."""
    m = member_logits.shape[0]
    return torch.logsumexp(member_logits.float().log_softmax(-1), dim=0) - math.log(m)


def per_example_nll(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[N]`` −log p(y|x) from ``[N, C]`` log probabilities."""
    return -log_probs.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def nll(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood of the labels under ``probs``."""
    return per_example_nll(probs.clamp_min(EPS).log(), labels).mean().item()


def nll_from_member_logits(member_logits: torch.Tensor, labels: torch.Tensor) -> float:
    """NLL of the mixture, computed stably in log space."""
    return per_example_nll(mixture_log_probs(member_logits), labels).mean().item()


def per_example_brier(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    onehot = torch.nn.functional.one_hot(labels.long(), probs.shape[-1]).to(probs.dtype)
    return (probs - onehot).pow(2).sum(-1)


def brier(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Multi-class Brier score: mean over examples of Σ_c (p_c − 1[y=c])²."""
    return per_example_brier(probs, labels).mean().item()


def ece_from_confidence(
    confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = 15
) -> float:
    """Expected calibration error over ``n_bins`` equal-width confidence bins."""
    confidence = confidence.double()
    correct = correct.double()
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    # bin b holds confidences in (edge_b, edge_{b+1}]; confidence 0 falls in bin 0
    idx = (torch.bucketize(confidence, edges, right=False) - 1).clamp(0, n_bins - 1)
    total = torch.zeros((), dtype=torch.float64)
    n = confidence.shape[0]
    for b in range(n_bins):
        mask = idx == b
        if mask.any():
            gap = (correct[mask].mean() - confidence[mask].mean()).abs()
            total += gap * mask.sum() / n
    return total.item()


def ece(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> float:
    conf, pred = probs.max(-1)
    return ece_from_confidence(conf, (pred == labels).float(), n_bins)


def reliability_bins(
    confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = 15
) -> list[tuple[float, float, float, int]]:
    """``(bin centre, mean confidence, accuracy, count)`` for each non-empty bin."""
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    idx = (torch.bucketize(confidence.double(), edges) - 1).clamp(0, n_bins - 1)
    out = []
    for b in range(n_bins):
        mask = idx == b
        if mask.any():
            out.append((
                (edges[b] + edges[b + 1]).item() / 2,
                confidence[mask].double().mean().item(),
                correct[mask].double().mean().item(),
                int(mask.sum()),
            ))
    return out


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` → ``[...]`` Shannon entropy −Σ p log p (nats)."""
    return -(probs * probs.clamp_min(EPS).log()).sum(-1)


def expected_entropy(member_probs: torch.Tensor) -> torch.Tensor:
    """Aleatoric part: E_m[H(p_m)], ``[M, N, C]`` → ``[N]``."""
    return entropy(member_probs).mean(0)


def mutual_information(member_probs: torch.Tensor) -> torch.Tensor:
    """Epistemic part (BALD): H(E_m p_m) − E_m H(p_m), ``[M, N, C]`` → ``[N]`` (≥ 0)."""
    return (entropy(member_probs.mean(0)) - expected_entropy(member_probs)).clamp_min(0)


def variation_ratio(member_probs: torch.Tensor) -> torch.Tensor:
    """1 − (votes for the modal class) / M, ``[M, N, C]`` → ``[N]``."""
    m, _, c = member_probs.shape
    votes = torch.nn.functional.one_hot(member_probs.argmax(-1), c).sum(0)
    return 1.0 - votes.max(-1).values.float() / m


def auroc(scores_negative: torch.Tensor, scores_positive: torch.Tensor) -> float:
    """Area under the ROC curve: P(score_pos > score_neg) + ½ P(tie).

    Mann–Whitney U with average ranks for ties. For OOD detection the OOD
    examples are the positives and the score is an uncertainty (entropy, MI).
    """
    neg = scores_negative.double().flatten()
    pos = scores_positive.double().flatten()
    scores = torch.cat([neg, pos])
    order = scores.argsort()
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average ranks over ties
    unique, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    if unique.numel() < scores.numel():
        rank_sum = torch.zeros_like(unique).index_add_(0, inverse, ranks[order])
        ranks[order] = (rank_sum / counts)[inverse]
    n_pos, n_neg = pos.numel(), neg.numel()
    u = ranks[neg.numel():].sum() - n_pos * (n_pos + 1) / 2
    return (u / (n_pos * n_neg)).item()


def entropy_cdf_auc(entropies: torch.Tensor, num_classes: int) -> float:
    """Area under the empirical CDF of normalised entropy H / log C on [0, 1].

    Equals 1 − mean(H / log C). On OOD data lower is better (more uncertainty).
    """
    normalised = (entropies.double() / math.log(num_classes)).clamp(0, 1)
    return (1.0 - normalised.mean()).item()


def has_signal(*scores: torch.Tensor, tol: float = 1e-5) -> bool:
    """Whether pooled scores vary at all (beyond float noise): the mutual information of
    a single network is 0 up to rounding, and ranking by it is ranking noise."""
    pooled = torch.cat([s.double().flatten() for s in scores])
    return pooled.numel() > 0 and bool(pooled.max() - pooled.min() > tol)


def ood_auroc(scores_in: torch.Tensor, scores_ood: torch.Tensor) -> float | None:
    """:func:`auroc` of an uncertainty score (OOD = positives); ``None`` ("n/a") when the
    score carries no signal (:func:`has_signal`), e.g. a single network's MI."""
    if not has_signal(scores_in, scores_ood):
        return None
    return auroc(scores_in, scores_ood)
