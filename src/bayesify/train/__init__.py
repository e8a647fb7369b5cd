"""Training: the one epoch driver of every family, its fit context and the knob search.

``fit`` is data parallel under ``torchrun`` (DDP, sharded global batches,
per-rank noise streams), supports bf16 AMP, ``channels_last``, ``torch.compile``,
gradient accumulation and clipping, and writes atomic, resumable checkpoints.
"""

from bayesify.train.context import TrainContext, TrainState
from bayesify.train.distributed import DistContext, cleanup_distributed, setup_distributed
from bayesify.train.evaluate import evaluate_sharded
from bayesify.train.loop import FitResult, fit
from bayesify.train.schedules import beta_schedule, lr_factor, parse_schedule
from bayesify.train.tuning import tune

__all__ = [
    "DistContext",
    "FitResult",
    "TrainContext",
    "TrainState",
    "beta_schedule",
    "cleanup_distributed",
    "evaluate_sharded",
    "fit",
    "lr_factor",
    "parse_schedule",
    "setup_distributed",
    "tune",
]
