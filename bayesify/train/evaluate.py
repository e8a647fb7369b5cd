"""Validation during training, sharded over ranks.

Each rank predicts a contiguous, unpadded shard of the validation set (every
example exactly once), keeps per-example statistics only (NLL, confidence,
correctness, Brier, entropy, aleatoric, epistemic — 7 numbers per example, not
``[N, C]`` probabilities), and the shards are gathered so every rank returns the
same metrics as a single-process ``predictor.evaluate`` over the whole set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from bayesify import metrics
from bayesify.core.batch import iter_batches
from bayesify.core.checks import check_labels
from bayesify.errors import BayesifyError
from bayesify.train.data import ShardSampler, _loader_kwargs
from bayesify.train.distributed import DistContext, all_gather_objects

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

_FIELDS = ("nll", "confidence", "correct", "brier", "entropy", "aleatoric", "epistemic")


def shard_loader(loader: Iterable, ctx: DistContext) -> Iterable:
    """This rank's shard of an evaluation ``DataLoader`` (the loader itself otherwise)."""
    if not ctx.distributed or not isinstance(loader, DataLoader) or loader.batch_size is None:
        return loader
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return loader
    sampler = ShardSampler(n, rank=ctx.rank, world_size=ctx.world_size)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                      **_loader_kwargs(loader))


@torch.no_grad()
def per_example_stats(predictor: Any, loader: Iterable, *, device: torch.device,
                      amp: bool = False, channels_last: bool = False,
                      batch_fn: Any = None, labels: bool | str = True,
                      allow_empty: bool = False, keep_probs: bool = False) -> dict[str, Any]:
    """``{field: [n]}`` CPU tensors over ``loader``, plus ``members`` and ``num_classes``.

    The one per-example statistics function (predictor evaluation, validation in
    ``fit``, the CLI, ``evaluation.report``): NLL, confidence, correctness and Brier
    need labels (``labels=True``; ``"if_valid"``: only for batches whose labels are all
    ``>= 0``, negative labels marking out-of-distribution data); entropy, aleatoric and
    epistemic do not. ``keep_probs`` also keeps ``probs``/``log_probs [n, C]`` and
    ``labels [n]``.
    """
    keep: dict[str, list[torch.Tensor]] = {k: [] for k in (*_FIELDS, "probs", "log_probs",
                                                            "labels")}
    members, classes = 0, 0
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if amp
                else contextlib.nullcontext())
    for batch in iter_batches(loader, device=device, batch_fn=batch_fn, channels_last=channels_last):
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


def evaluate_sharded(
    bnn: BayesianModel | Any,
    loader: Iterable,
    ctx: DistContext | None = None,
    *,
    samples_per_component: int | None = None,
    amp: bool = False,
    channels_last: bool = False,
    n_bins: int = 15,
    batch_fn: Any = None,
) -> dict[str, float]:
    """Accuracy, error, NLL, ECE (``n_bins`` bins), Brier, entropy, aleatoric, epistemic.

    Identical on every rank; equal to ``bnn.predictor(n).evaluate(loader)`` up to
    float summation order. ``bnn`` may also be any predictor (e.g. a ``ModelPredictor``
    of the starting network).
    """
    from bayesify.core.model import BayesianModel

    predictor = bnn.predictor(samples_per_component) if isinstance(bnn, BayesianModel) else bnn
    ctx = ctx or DistContext(device=predictor.device)
    stats = per_example_stats(predictor, shard_loader(loader, ctx), device=predictor.device,
                              amp=amp, channels_last=channels_last, batch_fn=batch_fn,
                              allow_empty=ctx.distributed)
    shards = all_gather_objects(stats, ctx)
    full: dict[str, Any] = {k: torch.cat([sh[k] for sh in shards]) for k in _FIELDS}
    full["members"] = max(int(sh["members"]) for sh in shards)
    return summarize(full, n_bins=n_bins)
