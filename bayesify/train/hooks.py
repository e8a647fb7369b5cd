"""What the epoch driver reports: history log, callbacks, the starting network's metrics.

``history.jsonl`` (rank 0) gets one JSON record per epoch; callbacks are objects with
optional ``on_step_end(ctx, terms)`` / ``on_epoch_end(ctx, record)`` (a plain callable
is ``on_epoch_end``); a fit that ends clearly worse than its starting network warns.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bayesify.core.batch import BatchFn
from bayesify.predict.predictor import ModelPredictor
from bayesify.train import evaluate as evaluation
from bayesify.train.distributed import DistContext

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def starting_metrics(bnn: BayesianModel, val_loader: Iterable, ctx: DistContext, *,
                      batch_fn: BatchFn | None, amp: bool,
                      progress: bool = True) -> dict[str, float]:
    """Validation accuracy and NLL of the network the fit starts from (the base)."""
    base = ModelPredictor(bnn.unwrap().eval())
    base.batch_fn = batch_fn
    metrics = evaluation.evaluate_sharded(base, val_loader, ctx, amp=amp, batch_fn=batch_fn,
                                          progress=progress, desc="validate the start")
    return {k: metrics[k] for k in ("accuracy", "nll") if k in metrics}


def warn_if_worse(family: str, start: dict[str, float], last: dict[str, Any]) -> None:
    """A fit that ends clearly worse than its starting network says so (and what to try)."""
    acc, nll = last.get("val_accuracy"), last.get("val_nll")
    if acc is None or nll is None or "accuracy" not in start:
        return
    worse = []
    if acc < start["accuracy"] - 0.01:
        worse.append(f"accuracy {acc:.4f} < {start['accuracy']:.4f}")
    if nll > start["nll"] * 1.1 + 1e-3:
        worse.append(f"NLL {nll:.4f} > {start['nll']:.4f}")
    if worse:
        warnings.warn(
            f"fit of {family!r} ended with validation {' and '.join(worse)} of the starting "
            "network; try a lower lr, fewer epochs, or a smaller initial posterior spread "
            "(see `bayesify methods " + family + "`)", stacklevel=3,
        )


class HistoryLog:
    """``history.jsonl`` in ``log_dir`` (rank 0 only): one JSON record per epoch."""

    def __init__(self, log_dir: str | Path | None, ctx: DistContext) -> None:
        self.path = Path(log_dir) / "history.jsonl" if log_dir is not None and ctx.is_main else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record, default=float) + "\n")


class Callback:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def on_step_end(self, state: Any, terms: dict[str, float]) -> None:
        fn = getattr(self.obj, "on_step_end", None)
        if fn is not None:
            fn(state, terms)

    def on_epoch_end(self, state: Any, record: dict[str, Any]) -> None:
        fn = getattr(self.obj, "on_epoch_end", None)
        if fn is None and callable(self.obj):
            fn = self.obj
        if fn is not None:
            fn(state, record)


def as_callback(obj: Any) -> Callback:
    return Callback(obj)
