"""Process-group plumbing on PyTorch's own distributed engine (``torchrun``).

Nothing home-made: ``torchrun`` (single or multi node, its own rendezvous) sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``; we only
call ``init_process_group`` with ``nccl`` on CUDA and ``gloo`` on CPU. Without
those variables everything degrades to a single process (rank 0 of 1) and every
collective below is the identity.

A rank that stops answering (hung, or killed without the group noticing) fails
every collective after ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`, 10 min,
instead of the backends' 30 min). On gloo, :func:`naming_unresponsive_ranks`
turns that timeout into a :class:`BayesifyError` that names the rank(s) that did
not answer (found with ``monitored_barrier``). NCCL aborts the process on its
own watchdog timeout; the rank appears in NCCL's log line.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bayesify.errors import BayesifyError

#: seconds a collective waits for the other ranks before failing
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: ``rank`` of ``world_size``, its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    created_group: bool = False
    #: how long a collective waits for the other ranks (seconds)
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether the ``torchrun`` environment variables are present."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_timeout(timeout_s: Any) -> float:
    """``timeout_s`` as a float; ``None`` → :data:`DEFAULT_TIMEOUT_S`; must be finite and > 0."""
    if timeout_s is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__} "
                        f"{timeout_s!r}")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise BayesifyError(f"timeout_s must be a finite number of seconds > 0 (default "
                            f"{DEFAULT_TIMEOUT_S:g}), got {timeout_s!r}")
    return float(timeout_s)


def setup_distributed(device: str | torch.device | None, fallback: torch.device, *,
                      timeout_s: float | None = DEFAULT_TIMEOUT_S) -> DistContext:
    """Initialise the default process group when launched by ``torchrun``.

    ``device``: the requested device (``None`` → ``fallback``, the model's). Under
    ``torchrun`` a CUDA device becomes ``cuda:LOCAL_RANK``. Reuses a process group
    the caller already created (its own timeout then applies to the backend).
    ``timeout_s``: how long any collective waits for the other ranks before it
    fails (default 10 min; ``None`` → the default).
    """
    timeout_s = check_timeout(timeout_s)
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
        dist.init_process_group(backend="nccl" if target.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
        created = True
    backend = dist.get_backend()
    if backend == "nccl" and target.type != "cuda":
        raise BayesifyError(
            "the process group uses nccl but the model is on the CPU; pass device='cuda' "
            "or initialise the group with backend='gloo'"
        )
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local_rank, device=target, created_group=created,
                       timeout_s=timeout_s)


def current_context(device: torch.device) -> DistContext:
    """Where this process sits in a process group the caller already initialised (rank 0
    of 1 without one); never creates a group."""
    if dist.is_available() and dist.is_initialized():
        return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                           local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=device)
    return DistContext(device=device)


_TIMEOUT_TEXT = re.compile(r"timed? ?out|timeout|connection (closed|reset)|broken pipe|"
                           r"peer|failed to pass monitoredbarrier", re.IGNORECASE)


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` looks like a collective that failed because a rank did not answer."""
    return isinstance(err, RuntimeError) and bool(_TIMEOUT_TEXT.search(str(err)))


def unresponsive_ranks(ctx: DistContext, *, wait_s: float = 10.0) -> list[int] | None:
    """Ranks that do not check in on the process group's key-value store within ``wait_s``.

    Called by every rank whose collective failed: each writes a key for this
    failure and waits for the others' keys. A hung or dead rank never writes
    its key. The store is used, not a collective: after a timeout the gloo
    connections are closed. ``None`` when no store can be reached.
    """
    if not (ctx.distributed and dist.is_available() and dist.is_initialized()):
        return None
    store = _default_store()
    if store is None:
        return None
    prefix = f"bayesify/checkin/{next(_FAILURES)}/"
    try:
        store.set(f"{prefix}{ctx.rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(ctx.world_size) if not store.check([f"{prefix}{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store itself is gone (rank 0 died): unknown
        return None


_FAILURES = itertools.count()


def _default_store() -> Any:
    # torch has no public accessor for the default group's store; fall back to
    # "unknown" if this private one ever goes away
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:  # noqa: BLE001
        return None


def describe_collective_failure(err: BaseException, ctx: DistContext) -> BayesifyError:
    """A :class:`BayesifyError` naming the rank(s) that did not answer a collective."""
    ranks = unresponsive_ranks(ctx, wait_s=min(max(ctx.timeout_s, 1.0), 10.0))
    if ranks:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        what = f"{who} of {ctx.world_size} did not answer"
    else:
        what = f"a rank of {ctx.world_size} did not answer (which one could not be determined)"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return BayesifyError(
        f"distributed training stopped on rank {ctx.rank}: {what} within the "
        f"{ctx.timeout_s:g} s timeout ({first}). Check that process (crashed, hung, out of "
        "memory, stuck in data loading); raise fit(timeout_s=...) if steps are legitimately slow"
    )


@contextlib.contextmanager
def naming_unresponsive_ranks(ctx: DistContext) -> Iterator[None]:
    """Turn a collective that failed on a silent rank into an error naming that rank."""
    try:
        yield
    except RuntimeError as err:
        if ctx.distributed and is_collective_failure(err):
            raise describe_collective_failure(err, ctx) from err
        raise


@contextlib.contextmanager
def rank_zero_warnings(ctx: DistContext) -> Iterator[None]:
    """Only rank 0 speaks: on the other ranks of a process group, warnings raised inside are
    dropped (every rank sees the same run, so rank 0's warnings are the run's; without this,
    ``torchrun --nproc_per_node=N`` prints each one N times)."""
    if ctx.is_main:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def cleanup_distributed() -> None:
    """Destroy the default process group if one exists (call once at script end)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Mean over ranks of a ``[n]`` tensor (identity in a single process)."""
    if not ctx.distributed:
        return values
    out = values.detach().clone()
    with naming_unresponsive_ranks(ctx):
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / ctx.world_size


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if not ctx.distributed:
        return values
    out = values.detach().clone()
    with naming_unresponsive_ranks(ctx):
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def gather_objects(obj: Any, ctx: DistContext) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (``None`` elsewhere). Trusted peers only."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    with naming_unresponsive_ranks(ctx):
        dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    with naming_unresponsive_ranks(ctx):
        dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    with naming_unresponsive_ranks(ctx):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        with naming_unresponsive_ranks(ctx):
            dist.barrier()


def rank_seed(seed: int, rank: int) -> int:
    """A distinct, reproducible 63-bit seed for the noise stream of ``rank``."""
    return (seed * 1_000_003 + 7_919 * (rank + 1)) % (2**63 - 1)
