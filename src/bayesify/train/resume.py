"""Saving and restoring the full training state (see :mod:`bayesify.train.checkpoint`).

What is saved: posterior tensors, trainable base tensors, the model's buffers,
the optimiser (momentum etc.), epoch / batch-in-epoch / optimiser step, the
running sums of a partial epoch, the history, the RNG streams of *every*
rank (gathered to rank 0: global CPU, global CUDA, this rank's noise stream), and what
the never-worse rules hold of the fit's start (``carried``: the start's validation
metrics, the starting and best states; :mod:`bayesify.train.best`,
:mod:`bayesify.train.start_guard`).
LR and β schedules are pure functions of progress *and the run's length*, so the
epoch and step are their whole state only for the same length: a checkpoint
records ``epochs`` and ``steps_per_epoch`` (what cosine / cyclic schedules, snapshot
cycles and SWAG's collection are computed from; the schedule options, KL annealing,
accumulation and the family config are compared as fit options / identity), and
:func:`check_schedule` refuses to resume under a different length. Together with a data order that is a function of
``(seed, epoch)`` this makes a resumed run reproduce the uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import RandomSampler

from bayesify.atomic_files import directory_lock
from bayesify.errors import BayesifyError, NonFiniteLossError
from bayesify.kit import laplace_heads
from bayesify.train.checkpoint import (
    FORMAT,
    VERSION,
    atomic_save,
    check_compatible,
    checkpoint_name,
    content_checksum,
    identity,
    list_checkpoints,
    load_resumable,
    new_run_id,
    nonfinite_tensors,
    prune,
    rng_state,
    set_rng_state,
)
from bayesify.train.distributed import DistContext, broadcast_object, gather_objects

if TYPE_CHECKING:
    from bayesify.train.context import TrainState

__all__ = ["Run", "carried", "check_schedule", "identity", "probe_directory", "probe_outputs",
           "read_for_resume", "restore", "result_options", "save"]

logger = logging.getLogger(__name__)


def check_schedule(meta: dict[str, Any], state: TrainState, path: str | Path) -> None:
    """Refuse to resume a run of another length (its schedules would not continue). A
    finished statistics pass (one epoch, no optimiser: Laplace) has no schedule left to
    continue: it resumes with any loader."""
    problems = []
    finished = (meta.get("epochs") is not None and meta.get("epoch") == meta.get("epochs")
                and meta.get("global_step") == 0 and state.optimizer is None)
    checked = (("epochs", state.epochs),) if finished else (
        ("epochs", state.epochs), ("steps_per_epoch", state.steps_per_epoch))
    for key, now in checked:
        saved = meta.get(key)
        if saved is not None and saved != now:
            problems.append(f"{key}: checkpoint {saved!r}, now {now!r}")
    if problems:
        raise BayesifyError(
            f"checkpoint {str(path)!r} belongs to a run of another length ("
            + "; ".join(problems) + "). The learning-rate schedule, snapshot cycles and "
            "SWAG's collection are laid out over the whole run, so continuing it with another "
            f"length would not be the run that was checkpointed: resume with "
            f"epochs={meta.get('epochs')!r} and the same loader (batches per epoch), or start "
            "a new checkpoint directory")


def probe_directory(directory: str | Path, *, what: str) -> str | None:
    """Why ``directory`` cannot take this run's files (``None``: it can).

    Probed for real, not guessed from permission bits: the directory is created (as
    the first write would) and a uniquely named empty file is created in it and
    deleted again. A path that is a regular file, a read-only or full file system, a
    missing permission: each is found here, before the first step, instead of after
    the first epoch has trained.
    """
    directory = Path(directory)
    try:
        if directory.exists() and not directory.is_dir():
            return (f"{what}={str(directory)!r} is a file, not a directory: pass a directory "
                    "path (created if missing)")
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".bayesify-write-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        reason = err.strerror or str(err)
        return (f"{what}={str(directory)!r} cannot be written ({type(err).__name__}: {reason}); "
                "pass a writable directory")
    return None


def probe_outputs(*, checkpoint_dir: str | Path | None, log_dir: str | Path | None) -> str | None:
    """The first problem with the fit's output locations (``None``: all writable); see
    :func:`probe_directory`. ``log_dir``'s ``history.jsonl``, if present, must be a file."""
    if checkpoint_dir is not None:
        problem = probe_directory(checkpoint_dir, what="checkpoint_dir")
        if problem:
            return problem
    if log_dir is not None:
        problem = probe_directory(log_dir, what="log_dir")
        if problem:
            return problem
        history = Path(log_dir) / "history.jsonl"
        if history.exists() and not history.is_file():
            return (f"log_dir={str(log_dir)!r}: {str(history)!r} exists and is not a file; "
                    "remove it or pass another log_dir")
    return None


def result_options(state: TrainState) -> dict[str, Any]:
    """Run settings besides the fit options that change the final posterior, recorded in
    every checkpoint and compared on resume (:func:`~bayesify.train.checkpoint.check_compatible`):
    whether BatchNorm statistics train (``bn_train``), whether a validation / shift loader
    was given (the knob search at the end uses them) and, for gradient steps, whether the
    training loader shuffles and whether AMP is on."""
    options: dict[str, Any] = {
        "bn_train": bool(state.bnn.bn_train),
        "val_loader": state.val_loader is not None,
        "shift_loader": state.shift_loader is not None,
    }
    if state.optimizer is not None and state.data is not None:
        sampler = getattr(state.data.original, "sampler", None)
        options["shuffle"] = (state.data.sampler.shuffle if state.data.sampler is not None
                              else isinstance(sampler, RandomSampler))
        options["amp"] = bool(state.amp)
    return options


@dataclass
class Run:
    """Checkpoint settings and what a checkpoint must match to be resumed."""

    directory: Path | None
    keep: int = 2
    every: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)
    #: this run's id (file-name suffix; ``None`` until the first save or a resume)
    run_id: str | None = None
    #: the directory of the checkpoint this run was resumed from
    resumed_from: Path | None = None

    def id_for_writing(self) -> str:
        """The run id used in file names: kept across resumes into the same directory,
        new (:func:`new_run_id`) otherwise, so no two runs share a file name."""
        if self.run_id is not None and self.resumed_from is not None and self.directory is not None:
            if self.resumed_from.resolve() != self.directory.resolve() and \
                    list_checkpoints(self.directory):
                self.run_id = None  # resumed elsewhere into a used directory: a new id
            self.resumed_from = None
        if self.run_id is None:
            assert self.directory is not None
            self.run_id = new_run_id(self.directory)
        return self.run_id

    def every_steps(self, state: TrainState) -> bool:
        return self.every > 0 and state.global_step % self.every == 0


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _payload(state: TrainState, run: Run, run_id: str, rng: list[Any]) -> dict[str, Any]:
    bnn, ctx = state.bnn, state.ctx
    held = {name: keeper.carry() for name, keeper in state.carried.items()}
    meta = {
        "identity": run.identity, "options": run.options, "epoch": state.epoch,
        "step": state.step, "global_step": state.global_step,
        "world_size": ctx.world_size, "epochs": state.epochs,
        "steps_per_epoch": state.steps_per_epoch, "run_id": run_id,
        "history": state.history, "totals": state.totals,
        "carried": {name: numbers for name, (numbers, _) in held.items()},
    }
    return {
        "carried": {name: tensors for name, (_, tensors) in held.items()},
        "format": FORMAT, "version": VERSION,
        "meta": json.dumps(meta, default=float),
        "posterior": {n: _cpu(p) for n, p in bnn.named_posterior_parameters()},
        "base": {n: _cpu(p) for n, p in bnn.named_base_parameters() if p.requires_grad},
        "buffers": {n: _cpu(b) for n, b in bnn.named_buffers()},
        "optimizer": state.optimizer.state_dict() if state.optimizer is not None else {},
        "rng": rng,
    }


def save(state: TrainState, run: Run) -> str:
    """Write a checkpoint of ``state`` (collective: every rank must call it).

    The payload carries a content checksum (verified on load). A state holding
    NaN/inf is never written: every rank raises :class:`NonFiniteLossError`
    naming the tensors, and the newest checkpoint on disk stays the last finite one.
    """
    assert run.directory is not None
    ctx = state.ctx
    noise = state.noise_generator or torch.Generator(device=ctx.device)
    rng = gather_objects(rng_state(noise, ctx.device), ctx)
    error: str | None = None
    nonfinite: list[str] = []
    last = "no earlier checkpoint "
    cause: BaseException | None = None
    path = run.directory / checkpoint_name(state.epoch, state.global_step, run.run_id or "")
    if ctx.is_main:
        try:
            run.directory.mkdir(parents=True, exist_ok=True)
            # the run id is chosen and the first file written under the directory's lock:
            # two runs starting together in an empty directory never share a name
            with directory_lock(run.directory):
                run_id = run.id_for_writing()
                path = run.directory / checkpoint_name(state.epoch, state.global_step, run_id)
                payload = _payload(state, run, run_id, rng)
                nonfinite = nonfinite_tensors(payload)
                kept = list_checkpoints(run.directory, run_id=run_id)
                if kept:
                    last = f"the newest checkpoint of this run there, {kept[-1].name}, "
                if not nonfinite:
                    payload["checksum"] = content_checksum(payload)
                    atomic_save(payload, path)
                    prune(run.directory, run.keep, run_id=run_id)
        except Exception as err:  # noqa: BLE001 - reported on every rank below, never half-written
            error, cause = f"{type(err).__name__}: {err}", err
    error, nonfinite, last, path = broadcast_object((error, nonfinite, last, path), ctx)
    if nonfinite:
        raise NonFiniteLossError(
            f"refusing to write checkpoint {str(path)!r} (epoch {state.epoch}, optimiser step "
            f"{state.global_step}): the training state holds NaN/inf in {nonfinite[:5]}"
            f"{'…' if len(nonfinite) > 5 else ''}; training diverged (lower the learning rate or "
            f"check the inputs for NaN/inf). Nothing was written: {last}holds the last finite state"
        )
    if error is not None:
        raise BayesifyError(
            f"writing checkpoint {str(path)!r} failed ({error}); earlier checkpoints in "
            f"{str(run.directory)!r} are untouched"
        ) from cause
    return str(path)


def read_for_resume(resume: str | Path, ctx: DistContext) -> dict[str, Any]:
    """Rank 0 reads and verifies the checkpoint (falling back past damaged ones in a
    directory); every rank gets the payload (or the error)."""
    box: dict[str, Any]
    if ctx.is_main:
        try:
            path, box = load_resumable(resume)
            box["path"] = str(path)
        except BayesifyError as err:
            box = {"error": str(err)}
    else:
        box = {}
    box = broadcast_object(box, ctx)
    if "error" in box:
        raise BayesifyError(box["error"])
    return box


def _load_named(target: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], what: str,
                path: str) -> None:
    if set(target) != set(saved):
        missing, extra = sorted(set(target) - set(saved)), sorted(set(saved) - set(target))
        raise BayesifyError(
            f"checkpoint {path!r}: {what} tensors do not match (missing {missing[:5]}, "
            f"unexpected {extra[:5]})"
        )
    with torch.no_grad():
        for name, tensor in target.items():
            value = saved[name]
            if value.shape != tensor.shape:
                raise BayesifyError(
                    f"checkpoint {path!r}: {what} tensor {name!r} has shape "
                    f"{tuple(value.shape)}, the model has {tuple(tensor.shape)}"
                )
            tensor.copy_(value.to(tensor.device, tensor.dtype))


def carried(payload: dict[str, Any] | None,
            name: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """What the never-worse rule ``name`` (``"best"``, ``"start_guard"``) wrote into the
    checkpoint ``payload`` (:meth:`~bayesify.train.best.BestState.carry`), or ``None``: no
    checkpoint, or one written by an older bayesify (the resumed fit then has no rule)."""
    if payload is None:
        return None
    numbers = (payload["meta"].get("carried") or {}).get(name)
    tensors = (payload.get("carried") or {}).get(name)
    if not isinstance(numbers, dict) or not isinstance(tensors, dict):
        return None
    return numbers, tensors


def restore(state: TrainState, payload: dict[str, Any], run: Run, *, path: str) -> None:
    """Load ``payload`` into the model, optimiser, RNG streams and ``state``."""
    meta = payload["meta"]
    check_compatible(meta, run.identity, run.options, path)
    check_schedule(meta, state, path)
    run.run_id, run.resumed_from = str(meta.get("run_id") or ""), Path(path).parent
    ctx = state.ctx
    states = payload.get("rng") or []
    if ctx.rank < len(states) and state.noise_generator is not None:
        # first: a record a generator refuses is an error before the model changes
        set_rng_state(states[ctx.rank], state.noise_generator, ctx.device, path=path)
    bnn = state.bnn
    _load_named(dict(bnn.named_posterior_parameters()), payload["posterior"], "posterior", path)
    trainable = {n: p for n, p in bnn.named_base_parameters() if p.requires_grad}
    _load_named(trainable, payload["base"], "trainable base", path)
    laplace_heads.restore(bnn, payload["buffers"], prefix="state.")  # a finished run's heads
    _load_named(dict(bnn.named_buffers()), payload["buffers"], "buffer", path)
    try:
        if state.optimizer is not None:
            state.optimizer.load_state_dict(payload["optimizer"])
    except (ValueError, KeyError, RuntimeError) as err:
        raise BayesifyError(f"checkpoint {path!r}: optimiser state does not fit ({err})") from err
    if meta.get("world_size") != ctx.world_size:
        warnings.warn(
            f"resuming a {meta.get('world_size')}-process checkpoint with {ctx.world_size} "
            "processes: the data order is kept (same global batch) but noise streams of "
            "ranks without a saved state are freshly seeded", stacklevel=3,
        )
    state.epoch = int(meta["epoch"])
    state.step = int(meta["step"])
    state.global_step = int(meta["global_step"])
    state.history[:] = list(meta.get("history", []))
    state.totals = dict(meta.get("totals") or {})
    if ctx.is_main:
        logger.info("resumed from %s at epoch %d, step %d of that epoch (global step %d, "
                    "%d epoch record(s) so far)", path, state.epoch + 1, state.step,
                    state.global_step, len(state.history))
