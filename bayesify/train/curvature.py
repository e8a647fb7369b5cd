"""The curvature pass of the one training loop (Laplace).

One gradient-free pass over this rank's contiguous, unpadded shard of the
training data (every example exactly once over all ranks); the family's
``accumulate`` adds each batch's curvature and loss to buffers, and its
``finish_fit`` all-reduces them and tunes the prior. Logging, callbacks, progress
and checkpoints are the loop's: the checkpoint after the pass holds the whole
posterior state, and resuming from it skips the pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from bayesify.core.batch import BatchFn, iter_batches
from bayesify.errors import BayesifyError
from bayesify.train.distributed import DistContext, all_reduce_sum
from bayesify.train.evaluate import shard_loader
from bayesify.train.steps import TrainState

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def fit_curvature(
    bnn: BayesianModel,
    loader: Iterable,
    *,
    ctx: DistContext,
    val_loader: Iterable | None,
    batch_fn: BatchFn | None,
    progress: bool,
    log_dir: str | Path | None,
    checkpoint_dir: str | Path | None,
    resume: str | Path | None,
    callbacks: list[Any],
    amp: bool | None,
    result: Any,
) -> Any:
    """One curvature pass, then ``method.finish_fit``; returns a ``FitResult``."""
    from bayesify.train import resume as ckpt
    from bayesify.train.hooks import HistoryLog

    method = bnn.method
    state = TrainState(bnn=bnn, optimizer=None, base_lrs=[], schedules=[],  # type: ignore[arg-type]
                       epochs=1, steps_per_epoch=0, n_train=0, kl_anneal_epochs=0.0,
                       beta_max=0.0, ctx=ctx)
    result.history = state.history
    checkpointing = checkpoint_dir is not None or resume is not None
    run = ckpt.Run(directory=Path(checkpoint_dir) if checkpoint_dir is not None else None,
                   options={"training": "curvature"},
                   identity=ckpt.identity(bnn) if checkpointing else {})
    if resume is not None:
        payload = ckpt.read_for_resume(resume, ctx)
        ckpt.restore(state, payload, run, path=payload["path"])
        if state.epoch >= 1:  # the pass is done: its posterior was restored
            bnn.eval()
            return result
    shard = shard_loader(loader, ctx)
    total = _num_batches(shard)
    method.begin_fit(bnn, steps_per_epoch=total, epochs=1)
    start = time.perf_counter()
    bnn.eval()
    bar = tqdm(total=total or None, desc=f"{method.name} curvature",
               disable=not (progress and ctx.is_main), leave=False, dynamic_ncols=True)
    examples, batches = 0, 0
    with torch.no_grad():
        for batch in iter_batches(shard, device=bnn.device, batch_fn=batch_fn):
            labels = batch.require_labels("fit")
            method.accumulate(bnn, batch.model_input(), labels)
            examples += batch.size
            batches += 1
            bar.update(1)
    bar.close()
    seen = int(all_reduce_sum(torch.tensor([float(examples)], dtype=torch.float64), ctx).item())
    if seen == 0:
        raise BayesifyError("the training loader produced no batches")
    record: dict[str, Any] = {"epoch": 1, "steps": batches, "examples": seen,
                              "world_size": ctx.world_size}
    record.update(method.finish_fit(bnn, train_loader=shard, val_loader=val_loader, ctx=ctx,
                                    batch_fn=batch_fn))
    if val_loader is not None:
        from bayesify.train.evaluate import evaluate_sharded
        from bayesify.train.hooks import starting_metrics, warn_if_worse

        metrics = evaluate_sharded(bnn, val_loader, ctx, batch_fn=batch_fn)
        record.update({f"val_{k}": v for k, v in metrics.items() if isinstance(v, float)})
        start_metrics = starting_metrics(bnn, val_loader, ctx, batch_fn=batch_fn, amp=False)
        record.update({f"start_val_{k}": v for k, v in start_metrics.items()})
        warn_if_worse(method.name, start_metrics, record)
    record["seconds"] = time.perf_counter() - start
    state.history.append(record)
    state.epoch = 1
    if run.directory is not None:
        result.last_checkpoint = ckpt.save(state, run)
    HistoryLog(log_dir, ctx).write(record)
    for hook in callbacks:
        hook.on_epoch_end(state, record)
    bnn.eval()
    return result


def _num_batches(loader: Iterable) -> int:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return 0
