"""The knob search: every declared knob chosen on streamed, sharded validation batches.

For every value of a :class:`~bayesify.core.fitting.Knob`'s grid the knob is set and the
validation split is streamed once, one batch at a time: each rank predicts its
contiguous shard and keeps only the per-example NLL, on the CPU (8 bytes per example;
the split is never held on the device). The shards are gathered in rank order, so every
rank sees the same ``[n]`` vectors a single process would, and the selection rule
(:func:`bayesify.core.selection.choose`) picks the value: among values the split cannot
tell from the best, the broadest posterior (``knob.prefer``), never one whose NLL exceeds
the starting network's (the defaults' contract). The choice stays installed, the knob's
``settle`` runs, and the curve goes into the record::

    {name: value, f"{name}_grid": [...], f"{name}_val_nll": [...], "base_val_nll": ...}

``fit(val_loader=...)`` runs it after the last epoch; :func:`tune` runs it on its own
(custom loops, the Hugging Face ``Trainer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bayesify.core.batch import Batch, BatchFn, call_model
from bayesify.core.fitting import Knob
from bayesify.core.outputs import logits_of
from bayesify.core.selection import choose
from bayesify.errors import BayesifyError
from bayesify.train.data import shard_batches
from bayesify.train.distributed import (
    DistContext,
    all_gather_objects,
    current_context,
    naming_unresponsive_ranks,
)

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger("bayesify")

Batches = Callable[[], Iterator[Batch]]


@torch.no_grad()
def validation_nll(bnn: BayesianModel, batches: Batches, ctx: DistContext) -> torch.Tensor:
    """``[n]`` per-example NLL (float64, CPU) of ``bnn``'s default predictor at temperature 1,
    over the whole split (this rank's shard streamed, the shards gathered in rank order)."""
    predictor = bnn.predictor(temperature=1.0)
    nll = []
    for batch in batches():
        pred = predictor.predict(batch.model_input())
        nll.append(pred.nll(batch.require_labels("the validation search")).double().cpu())
    return _gather(nll, ctx)


@torch.no_grad()
def base_validation_nll(bnn: BayesianModel, batches: Batches, ctx: DistContext) -> torch.Tensor:
    """``[n]`` per-example validation NLL of the starting network (``bnn.unwrap()``)."""
    base = bnn.unwrap().eval()
    out = []
    for batch in batches():
        labels = batch.require_labels("the validation search")
        logits = logits_of(call_model(base, batch.model_input())).float()
        out.append(F.cross_entropy(logits, labels, reduction="none").double().cpu())
    return _gather(out, ctx)


def _gather(parts: list[torch.Tensor], ctx: DistContext) -> torch.Tensor:
    mine = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)
    full = torch.cat(all_gather_objects(mine, ctx))
    if full.numel() == 0:
        raise BayesifyError("the validation loader produced no batches")
    return full


def search_knobs(bnn: BayesianModel, knobs: list[Knob], batches: Batches,
                 ctx: DistContext) -> dict[str, Any]:
    """Choose every knob in turn (see the module docstring); returns the record."""
    if not knobs:
        return {}
    record: dict[str, Any] = {}
    ceiling: float | None = None
    was_training = bnn.training
    bnn.eval()
    try:
        for knob in knobs:
            values = [float(v) for v in knob.grid]
            per_value = []
            for value in values:
                knob.set(value)
                per_value.append(validation_nll(bnn, batches, ctx))
            if ceiling is None:
                ceiling = float(base_validation_nll(bnn, batches, ctx).mean())
            index = choose(values, per_value, rule=knob.rule, prefer=knob.prefer, ceiling=ceiling)
            knob.set(values[index])
            record.update({knob.name: values[index], f"{knob.name}_grid": values,
                           f"{knob.name}_val_nll": [float(v.mean()) for v in per_value],
                           "base_val_nll": ceiling})
            logger.info("%s: %s = %.3g chosen on validation NLL (%s)", bnn.method_name,
                        knob.name, values[index], knob.meaning)
            if knob.settle is not None:
                record.update(knob.settle())
    finally:
        bnn.train(was_training)
    return record


def tune(bnn: BayesianModel, val_loader: Iterable, *, batch_fn: BatchFn | None = None) -> dict[str, Any]:
    """Choose the family's declared knobs (``bnn.method.knobs(bnn)``) on ``val_loader``.

    What ``fit(val_loader=...)`` does after its last epoch, for a model trained by another
    loop (``elbo_loss`` in a custom loop, the Hugging Face ``Trainer``). Under
    ``torchrun`` (a process group already initialised) every rank streams its shard and
    all ranks choose the same values. Returns the record (empty without knobs).
    """
    ctx = current_context(bnn.device)

    def batches() -> Iterator[Batch]:
        return shard_batches(val_loader, ctx, device=bnn.device, batch_fn=batch_fn)

    with naming_unresponsive_ranks(ctx):
        return search_knobs(bnn, bnn.method.knobs(bnn), batches, ctx)
