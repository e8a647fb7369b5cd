"""Per-example predictive statistics, summary metrics, OOD scores and corruption sweeps.

Everything works on any predictor with the ``BasePredictor`` interface
(``predictor(x) -> Prediction`` with ``[M, B, C]`` member logits), so bayesify's
posteriors, plain models and the peers' wrappers are scored by the same code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import metrics
from bayesify.evaluation.corruptions import corrupted_loader
from bayesify.predict.predictor import BasePredictor

STAT_KEYS = ("probs", "log_probs", "entropy", "aleatoric", "epistemic", "nll", "labels")


def predictive_statistics(predictor: BasePredictor, loader: Iterable,
                          batch_fn: Any = None) -> dict[str, torch.Tensor]:
    """Per-example statistics over a loader, on CPU (:func:`bayesify.train.evaluate.per_example_stats`).

    Returns ``probs``/``log_probs [N, C]`` (mixture mean), ``entropy``, ``aleatoric``
    (E_m H(p_m)), ``epistemic`` (MI) ``[N]`` and, when the loader has labels
    ``≥ 0``, ``labels [N]`` and ``nll [N]`` = −log p̄(y|x).
    """
    from bayesify.train.evaluate import per_example_stats

    stats = per_example_stats(predictor, loader, device=predictor.device, labels="if_valid",
                              keep_probs=True,
                              batch_fn=batch_fn or getattr(predictor, "batch_fn", None))
    return {k: stats[k] for k in STAT_KEYS if stats[k].numel()}


def summarize(stats: dict[str, torch.Tensor], *, n_bins: int = 15) -> dict[str, float]:
    """Accuracy, NLL, ECE (``n_bins`` equal-width bins), Brier and mean entropy/aleatoric/MI."""
    out = {
        "entropy": stats["entropy"].mean().item(),
        "aleatoric": stats["aleatoric"].mean().item(),
        "epistemic": stats["epistemic"].mean().item(),
    }
    if "labels" in stats:
        probs, labels = stats["probs"], stats["labels"]
        conf, pred = probs.max(-1)
        correct = (pred == labels).float()
        out.update({
            "accuracy": correct.mean().item(),
            "nll": stats["nll"].mean().item(),
            "ece": metrics.ece_from_confidence(conf, correct, n_bins),
            "brier": metrics.per_example_brier(probs, labels).mean().item(),
        })
    return out


def ood_scores(
    in_stats: dict[str, torch.Tensor], ood_stats: dict[str, torch.Tensor]
) -> dict[str, float]:
    """OOD detection with OOD as the positive class.

    ``ood_auroc_entropy`` / ``ood_auroc_mi``: AUROC of total entropy / mutual
    information as the score; ``ood_entropy_cdf_auc``: area under the empirical CDF
    of normalised OOD entropy H/log C (= 1 − mean H/log C; lower is better);
    ``in_entropy_cdf_auc`` the same on in-distribution data (higher is better).
    """
    num_classes = in_stats["probs"].shape[-1]
    return {
        "ood_auroc_entropy": metrics.ood_auroc(in_stats["entropy"], ood_stats["entropy"]),
        "ood_auroc_mi": metrics.ood_auroc(in_stats["epistemic"], ood_stats["epistemic"]),
        "ood_entropy_cdf_auc": metrics.entropy_cdf_auc(ood_stats["entropy"], num_classes),
        "in_entropy_cdf_auc": metrics.entropy_cdf_auc(in_stats["entropy"], num_classes),
        "ood_entropy": ood_stats["entropy"].mean().item(),
        "ood_aleatoric": ood_stats["aleatoric"].mean().item(),
        "ood_epistemic": ood_stats["epistemic"].mean().item(),
    }


def corruption_sweep(
    predictor: BasePredictor,
    dataset: TensorDataset,
    kind: str,
    levels: Sequence[float],
    *,
    seed: int = 0,
    batch_size: int = 512,
    n_bins: int = 15,
    keep_stats: bool = False,
) -> list[dict[str, Any]]:
    """One row per severity: accuracy, NLL, ECE, Brier and entropy = aleatoric + epistemic.

    With ``keep_stats`` every row also carries its per-example ``stats`` (for
    bootstrapping over test points).
    """
    rows = []
    for level in levels:
        loader: DataLoader = corrupted_loader(dataset, kind, level, seed=seed,
                                              batch_size=batch_size)
        stats = predictive_statistics(predictor, loader)
        row: dict[str, Any] = {"corruption": kind, "level": float(level), **summarize(stats, n_bins=n_bins)}
        if keep_stats:
            row["stats"] = stats
        rows.append(row)
    return rows


def bootstrap_se(
    statistic: Any, *samples: torch.Tensor, num: int = 200, seed: int = 0
) -> float:
    """Bootstrap standard error of ``statistic(*samples)`` over the rows of each sample.

    Every sample tensor is resampled with replacement along dim 0, independently
    of the others (for AUROC: in-distribution and OOD sets separately; tensors
    that belong together must be stacked into one sample by the caller).
    """
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(num):
        resampled = [s[torch.randint(0, s.shape[0], (s.shape[0],), generator=generator)]
                     for s in samples]
        values.append(float(statistic(*resampled)))
    return float(torch.tensor(values, dtype=torch.float64).std(unbiased=True))
