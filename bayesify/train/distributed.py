"""Process-group plumbing on PyTorch's own distributed engine (``torchrun``).

Nothing home-made: ``torchrun`` (single or multi node, its own rendezvous) sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``; we only
call ``init_process_group`` with ``nccl`` on CUDA and ``gloo`` on CPU. Without
those variables everything degrades to a single process (rank 0 of 1) and every
collective below is the identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bayesify.errors import BayesifyError


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: ``rank`` of ``world_size``, its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    created_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether the ``torchrun`` environment variables are present."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup_distributed(device: str | torch.device | None, fallback: torch.device) -> DistContext:
    """Initialise the default process group when launched by ``torchrun``.

    ``device``: the requested device (``None`` → ``fallback``, the model's). Under
    ``torchrun`` a CUDA device becomes ``cuda:LOCAL_RANK``. Reuses a process group
    the caller already created.
    """
    target = torch.device(device) if device is not None else fallback
    if not (dist.is_available() and (dist.is_initialized() or launched_by_torchrun())):
        return DistContext(device=target)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise BayesifyError("device is CUDA but torch.cuda.is_available() is False")
        target = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(target)
    created = False
    if not dist.is_initialized():
        world = int(os.environ["WORLD_SIZE"])
        if world <= 1:
            return DistContext(device=target, local_rank=local_rank)
        dist.init_process_group(backend="nccl" if target.type == "cuda" else "gloo")
        created = True
    backend = dist.get_backend()
    if backend == "nccl" and target.type != "cuda":
        raise BayesifyError(
            "the process group uses nccl but the model is on the CPU; pass device='cuda' "
            "or initialise the group with backend='gloo'"
        )
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local_rank, device=target, created_group=created)


def cleanup_distributed() -> None:
    """Destroy the default process group if one exists (call once at script end)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Mean over ranks of a ``[n]`` tensor (identity in a single process)."""
    if not ctx.distributed:
        return values
    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / ctx.world_size


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if not ctx.distributed:
        return values
    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def gather_objects(obj: Any, ctx: DistContext) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (``None`` elsewhere). Trusted peers only."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def rank_seed(seed: int, rank: int) -> int:
    """A distinct, reproducible 63-bit seed for the noise stream of ``rank``."""
    return (seed * 1_000_003 + 7_919 * (rank + 1)) % (2**63 - 1)
