"""Validation during training, sharded over ranks.

Each rank predicts a contiguous, unpadded shard of the validation set (every
example exactly once), keeps per-example statistics only (NLL, confidence,
correctness, Brier, entropy, aleatoric, epistemic — 7 numbers per example, not
``[N, C]`` probabilities), and the shards are gathered so every rank returns the
same metrics as a single-process ``predictor.evaluate`` over the whole set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from bayesify.predict.stats import FIELDS as _FIELDS
from bayesify.predict.stats import per_example_stats, summarize
from bayesify.train.data import shard_loader
from bayesify.train.distributed import DistContext, all_gather_objects

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


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
    progress: bool = False,
    desc: str = "validate",
) -> dict[str, float]:
    """Accuracy, error, NLL, ECE (``n_bins`` bins), Brier, entropy, aleatoric, epistemic.

    Identical on every rank; equal to ``bnn.predictor(n).evaluate(loader)`` up to
    float summation order. ``bnn`` may also be any predictor (e.g. a ``ModelPredictor``
    of the starting network). ``progress``: a bar named ``desc`` on rank 0.
    """
    from bayesify.core.model import BayesianModel

    if isinstance(bnn, BayesianModel):
        predictor = bnn.predictor(samples_per_component)
        predictor.during_fit = True  # a posterior fit is building may be validated
    else:
        predictor = bnn
    ctx = ctx or DistContext(device=predictor.device)
    stats = per_example_stats(predictor, shard_loader(loader, ctx), device=predictor.device,
                              amp=amp, channels_last=channels_last, batch_fn=batch_fn,
                              allow_empty=ctx.distributed, progress=progress and ctx.is_main,
                              desc=desc)
    shards = all_gather_objects(stats, ctx)
    full: dict[str, Any] = {k: torch.cat([sh[k] for sh in shards]) for k in _FIELDS}
    full["members"] = max(int(sh["members"]) for sh in shards)
    return summarize(full, n_bins=n_bins)
