"""Per-example statistics of a predictor over a loader, and their summary metrics.

One streaming pass keeps 7 numbers per example (NLL, confidence, correctness, Brier,
entropy, aleatoric, epistemic), never ``[N, C]`` probabilities unless asked; used by
``predictor.evaluate``, validation in ``fit`` (sharded, :mod:`bayesify.train.evaluate`),
the CLI and ``evaluation.report``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from bayesify import metrics
from bayesify.core.batch import iter_batches
from bayesify.core.checks import check_labels
from bayesify.errors import BayesifyError
from bayesify.progress import progress_bar

FIELDS = ("nll", "confidence", "correct", "brier", "entropy", "aleatoric", "epistemic")
_FIELDS = FIELDS


@torch.no_grad()
def per_example_stats(predictor: Any, loader: Iterable, *, device: torch.device,
                      amp: bool = False, channels_last: bool = False,
                      batch_fn: Any = None, labels: bool | str = True,
                      allow_empty: bool = False, keep_probs: bool = False,
                      progress: bool = False, desc: str = "evaluate") -> dict[str, Any]:
    """``{field: [n]}`` CPU tensors over ``loader``, plus ``members`` and ``num_classes``.

    The one per-example statistics function (predictor evaluation, validation in
    ``fit``, the CLI, ``evaluation.report``): NLL, confidence, correctness and Brier
    need labels (``labels=True``; ``"if_valid"``: only for batches whose labels are all
    ``>= 0``, negative labels marking out-of-distribution data); entropy, aleatoric and
    epistemic do not. ``keep_probs`` also keeps ``probs``/``log_probs [n, C]`` and
    ``labels [n]``. ``progress``: a bar named ``desc`` (rank 0 only).
    """
    keep: dict[str, list[torch.Tensor]] = {k: [] for k in (*FIELDS, "probs", "log_probs",
                                                            "labels")}
    members, classes = 0, 0
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if amp
                else contextlib.nullcontext())
    batches = progress_bar(loader, desc, enabled=progress) if progress else loader
    for batch in iter_batches(batches, device=device, batch_fn=batch_fn, channels_last=channels_last):
        with autocast:
            pred = predictor(batch.inputs_only())
        members = pred.num_members
        probs, log_probs = pred.probs.float(), pred.log_probs.float()
        classes = probs.shape[-1]
        y = batch.labels
        use_labels = labels is True or (labels == "if_valid" and y is not None
                                        and bool((y >= 0).all()))
        if use_labels:
            y = check_labels(batch.require_labels("evaluation"), classes, where="evaluation")
            conf, label = probs.max(-1)
            keep["nll"].append(metrics.per_example_nll(log_probs, y).cpu())
            keep["confidence"].append(conf.cpu())
            keep["correct"].append((label == y).float().cpu())
            keep["brier"].append(metrics.per_example_brier(probs, y).cpu())
            if keep_probs:
                keep["labels"].append(y.cpu())
        if keep_probs:
            keep["probs"].append(probs.cpu())
            keep["log_probs"].append(log_probs.cpu())
        keep["entropy"].append(pred.entropy.float().cpu())
        keep["aleatoric"].append(pred.aleatoric.float().cpu())
        keep["epistemic"].append(pred.epistemic.float().cpu())
    if not keep["entropy"] and not allow_empty:
        raise BayesifyError("the evaluation loader produced no batches")
    out: dict[str, Any] = {k: torch.cat(v) if v else torch.empty(0) for k, v in keep.items()}
    out["members"] = members
    out["num_classes"] = classes
    return out


def summarize(stats: dict[str, Any], *, n_bins: int = 15) -> dict[str, Any]:
    """Accuracy, error, NLL, ECE, Brier and mean uncertainties from per-example stats."""
    n = stats["nll"].numel()
    if n == 0:
        return {"n": 0}
    accuracy = stats["correct"].double().mean().item()
    return {
        "n": n,
        "members": int(stats["members"]),
        "accuracy": accuracy,
        "error": 1.0 - accuracy,
        "nll": stats["nll"].double().mean().item(),
        "ece": metrics.ece_from_confidence(stats["confidence"], stats["correct"], n_bins),
        "brier": stats["brier"].double().mean().item(),
        "entropy": stats["entropy"].double().mean().item(),
        "aleatoric": stats["aleatoric"].double().mean().item(),
        "epistemic": stats["epistemic"].double().mean().item(),
    }
