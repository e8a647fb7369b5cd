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
                      amp: bool = False, channels_last: bool = False) -> dict[str, Any]:
    """``{field: [n]}`` CPU tensors over ``loader`` (labels required), plus ``members``."""
    keep: dict[str, list[torch.Tensor]] = {k: [] for k in _FIELDS}
    members = 0
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if amp
                else contextlib.nullcontext())
    for batch in loader:
        x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast:
            pred = predictor(x)
        members = pred.num_members
        probs = pred.probs.float()
        conf, label = probs.max(-1)
        keep["nll"].append(metrics.per_example_nll(pred.log_probs.float(), y).cpu())
        keep["confidence"].append(conf.cpu())
        keep["correct"].append((label == y).float().cpu())
        keep["brier"].append(metrics.per_example_brier(probs, y).cpu())
        keep["entropy"].append(pred.entropy.float().cpu())
        keep["aleatoric"].append(pred.aleatoric.float().cpu())
        keep["epistemic"].append(pred.epistemic.float().cpu())
    out: dict[str, Any] = {k: torch.cat(v) if v else torch.empty(0) for k, v in keep.items()}
    out["members"] = members
    return out


def evaluate_sharded(
    bnn: BayesianModel,
    loader: Iterable,
    ctx: DistContext | None = None,
    *,
    samples_per_component: int | None = None,
    amp: bool = False,
    channels_last: bool = False,
    n_bins: int = 15,
) -> dict[str, float]:
    """Accuracy, error, NLL, ECE (``n_bins`` bins), Brier, entropy, aleatoric, epistemic.

    Identical on every rank; equal to ``bnn.predictor(n).evaluate(loader)`` up to
    float summation order.
    """
    ctx = ctx or DistContext(device=bnn.device)
    predictor = bnn.predictor(samples_per_component)
    stats = per_example_stats(predictor, shard_loader(loader, ctx), device=bnn.device,
                              amp=amp, channels_last=channels_last)
    shards = all_gather_objects(stats, ctx)
    full = {k: torch.cat([s[k] for s in shards]) for k in _FIELDS}
    n = full["nll"].numel()
    if n == 0:
        return {"n": 0}
    accuracy = full["correct"].double().mean().item()
    return {
        "n": n,
        "members": max(int(s["members"]) for s in shards),
        "accuracy": accuracy,
        "error": 1.0 - accuracy,
        "nll": full["nll"].double().mean().item(),
        "ece": metrics.ece_from_confidence(full["confidence"], full["correct"], n_bins),
        "brier": full["brier"].double().mean().item(),
        "entropy": full["entropy"].double().mean().item(),
        "aleatoric": full["aleatoric"].double().mean().item(),
        "epistemic": full["epistemic"].double().mean().item(),
    }
