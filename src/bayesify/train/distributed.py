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
import gc
import hashlib
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
from bayesify.version import __version__

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


def cleanup_distributed(*, barrier: bool = True) -> None:
    """Destroy the default process group if one exists (call once at script end), after a
    barrier: every rank reaches the end before any tears its connections down (without it,
    ``tests/ddp_scripts/fit_posthoc.py`` under ``torchrun --nproc_per_node=2`` ended in
    ``terminate called without an active exception`` on both ranks in 4 of 38 runs; with
    it, 0 of 75 alone — but once more inside a full test run, so the cause is not settled;
    benchmarks/results/session12.md). ``barrier=False`` on an error path where another rank
    may never arrive."""
    if dist.is_available() and dist.is_initialized():
        # objects in reference cycles that hold the group's work (a fit's DDP wrapper) are
        # freed now, while the group and the interpreter are alive, not at interpreter exit
        gc.collect()
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_mean(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Mean over ranks of a ``[n]`` tensor (identity in a single process)."""
    if not ctx.distributed:
        return values
    return all_reduce_sum(values, ctx) / ctx.world_size


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks (identity in a single process), on the device it came from. The
    reduction runs on the group's device (``ctx.device``): NCCL, the group ``torchrun`` on
    GPUs gets, has no CPU backend ("No backend type associated with device type cpu"), and
    counters are kept on the CPU."""
    if not ctx.distributed:
        return values
    out = values.detach().to(ctx.device, copy=True)
    with naming_unresponsive_ranks(ctx):
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(values.device)


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


# -- one exchange before the first step: every rank runs the same job --------------------
#: fit options every rank must pass alike (paths and loaders: whether they were given)
JOB_OPTIONS = (
    "epochs", "min_steps", "lr", "base_lr", "kl_anneal_epochs", "beta", "lr_schedule",
    "base_lr_schedule", "optimizer", "momentum", "weight_decay", "base_weight_decay", "n_train",
    "seed", "amp", "channels_last", "compile", "grad_accum_steps", "clip_grad_norm",
    "checkpoint_every_steps", "keep_checkpoints", "val_every", "val_samples_per_component",
    "find_unused_parameters", "timeout_s",
)
#: options compared by presence only (a path may differ between nodes; a loader is an object)
JOB_PRESENCE = ("resume", "checkpoint_dir", "val_loader", "shift_loader", "batch_fn")


def _plain(value: Any) -> Any:
    """A comparable, printable stand-in for an option value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"<{getattr(value, '__module__', '') or ''}.{name}>"


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = value


def _names_digest(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]


def _loader_facts(loader: Any) -> dict[str, Any]:
    """What fixes the batches of an epoch: dataset length, batch size, drop_last,
    sampler type and the loader's length (each ``None`` when the loader has none)."""
    facts: dict[str, Any] = {"type": type(loader).__qualname__}
    dataset = getattr(loader, "dataset", None)
    for key, get in (("dataset_length", lambda: len(dataset)),  # type: ignore[arg-type]
                     ("batches_per_epoch", lambda: len(loader))):
        try:
            facts[key] = int(get())
        except Exception:  # noqa: BLE001 - no length (iterable data set, generator)
            facts[key] = None
    facts["batch_size"] = getattr(loader, "batch_size", None)
    facts["drop_last"] = getattr(loader, "drop_last", None)
    sampler = getattr(loader, "sampler", None)
    facts["sampler"] = None if sampler is None else type(sampler).__qualname__
    return facts


def describe_job(bnn: Any, train_loader: Any, options: dict[str, Any]) -> dict[str, Any]:
    """What every rank of one ``fit`` must agree on, as flat ``{field: value}``.

    Model: method, config, targets, posterior shapes, base fingerprint (the base
    weights when wrapped), ``bn_train``, which base tensors train, dtype, torch and
    bayesify versions. Fit options: :data:`JOB_OPTIONS` by value,
    :data:`JOB_PRESENCE` by presence. Data: dataset length, batch size, drop_last,
    sampler, batches per epoch of ``train_loader``.
    """
    job: dict[str, Any] = {}
    trainable = [n for n, p in bnn.named_base_parameters() if p.requires_grad]
    first = next(iter(bnn.parameters()), None)
    model = {
        "method": bnn.method_name,
        "config": _plain(bnn.method.config.to_dict()),
        "targets": list(bnn.targets),
        "posterior_shapes": {n: list(p.shape) for n, p in bnn.named_posterior_parameters()},
        "base_fingerprint": bnn.base_fingerprint,
        "bn_train": bool(getattr(bnn, "bn_train", False)),
        # DDP reduces exactly the trainable tensors: every rank must have the same ones
        "trainable_base_tensors": f"{len(trainable)} ({_names_digest(trainable)})",
        "dtype": None if first is None else str(first.dtype),
        "versions": {"torch": torch.__version__, "bayesify": __version__},
    }
    _flatten("", model, job)
    for key in JOB_OPTIONS:
        if key in options:
            job[f"fit.{key}"] = _plain(options[key])
    for key in JOB_PRESENCE:
        if key in options:
            job[f"fit.{key} given"] = options[key] is not None
    _flatten("train_loader", _loader_facts(train_loader), job)
    return job


def agree_on_job(ctx: DistContext, job: Any, *, refusal: str | None = None) -> None:
    """One exchange before the first step: every rank's job (``job()``, a flat dict from
    :func:`describe_job`, called only when distributed) and refusal (e.g. rank 0's
    unwritable checkpoint directory) go to every rank, and every rank raises the same
    :class:`BayesifyError` naming each differing field with both values.

    Bounded by the fit's timeout: a rank that never arrives is named by
    :func:`naming_unresponsive_ranks`.
    """
    if not ctx.distributed:
        if refusal is not None:
            raise BayesifyError(refusal)
        return
    mine = {"job": job() if callable(job) else job, "refusal": refusal}
    everyone = all_gather_objects(mine, ctx)
    refusals = [f"rank {r}: {e['refusal']}" for r, e in enumerate(everyone) if e["refusal"]]
    if refusals:
        raise BayesifyError("fit stopped before the first step on every rank: "
                            + "; ".join(refusals))
    differences = job_differences([e["job"] for e in everyone])
    if differences:
        shown = differences[:8]
        more = f" (and {len(differences) - 8} more)" if len(differences) > 8 else ""
        raise BayesifyError(
            f"the {ctx.world_size} ranks of this torchrun do not run the same fit, so it was "
            "stopped before the first step on every rank: " + "; ".join(shown) + more
            + ". Every rank must get the same model (weights, method, config), the same fit "
            "options and the same training data (length, batch size, sampler); launch every "
            "process with the same script arguments"
        )


def job_differences(jobs: list[dict[str, Any]]) -> list[str]:
    """``"field: rank 0 has A, rank r has B"`` for every field where a rank differs from
    rank 0 (the first such rank named; how many more differ, if any)."""
    reference = jobs[0]
    out = []
    for key in sorted(set().union(*jobs), key=lambda k: (not k.startswith(("fit.", "train_")), k)):
        values = [job.get(key, "<missing>") for job in jobs]
        others = [r for r, v in enumerate(values) if v != reference.get(key, "<missing>")]
        if not others:
            continue
        first = others[0]
        tail = f" (and {len(others) - 1} other rank(s))" if len(others) > 1 else ""
        out.append(f"{key}: rank 0 has {_short(values[0])}, rank {first} has "
                   f"{_short(values[first])}{tail}")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def rank_seed(seed: int, rank: int) -> int:
    """A distinct, reproducible 63-bit seed for the noise stream of ``rank``."""
    return (seed * 1_000_003 + 7_919 * (rank + 1)) % (2**63 - 1)
