"""Atomic training checkpoints and their validation on resume.

A checkpoint is one ``torch.save`` file holding only tensors, numbers, strings,
lists and dicts, loaded back with ``torch.load(weights_only=True)`` (nothing is
ever unpickled). Layout::

    {"format": "bayesify-checkpoint", "version": 2,
     "meta": JSON string (method, config, targets, fit options, epoch, step, history…),
     "posterior": {name: tensor}, "base": {trainable base name: tensor},
     "buffers": {name: tensor}, "optimizer": optimizer.state_dict(),
     "rng": [per rank {"cpu": uint8, "cuda": uint8?, "noise": uint8}],
     "checksum": sha256 over everything above (see :func:`content_checksum`)}

Files are ``epoch{E:04d}-step{S:08d}.ckpt`` (E = completed epochs, S = optimiser
steps) in the checkpoint directory. Every run has an id, stored in its metadata:
the first run in an empty directory has the empty id and these plain names; a
later run sharing the directory gets a random id and names
``epoch{E:04d}-step{S:08d}-{ID}.ckpt``, and a resumed run keeps its id. Pruning
(``keep_checkpoints``) only ever deletes files of the run that writes, so runs
sharing a directory never delete or overwrite each other's checkpoints; resuming
from a directory continues the run that wrote most recently.

Writing goes to a fresh, randomly named temporary file in the same directory
(``O_EXCL | O_NOFOLLOW``: never a fixed name a symlink could redirect), is fsync'ed
and then ``os.replace``'d into place, so a failed or interrupted write never
touches an earlier checkpoint; older files are pruned only after the new one is
committed. Temporary files left by a killed writer (``.NAME.tmp-PID-XXXX`` whose
process is gone) are removed on the next write or resume.

Integrity: the checksum is recomputed from the loaded content and compared
before anything is used, and the RNG records are test-loaded into scratch
generators; a flipped bit anywhere is a :class:`BayesifyError`. Resuming from a
directory falls back to the newest checkpoint that passes these checks (with a
warning naming the skipped files). A state holding NaN/inf or overflowing values
in any section (posterior, trainable base, buffers, optimiser) is never written
nor resumed from.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import secrets
import struct
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bayesify.atomic_files import replace, write_temp
from bayesify.errors import BayesifyError
from bayesify.persistence import fingerprint

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

FORMAT = "bayesify-checkpoint"
VERSION = 2
_NAME = re.compile(r"epoch(\d{4,})-step(\d{8,})(?:-([0-9a-f]{8}))?\.ckpt")
_TMP = re.compile(r"\.(.+)\.tmp-(\d+)(?:-[0-9a-f]+)?")


def checkpoint_name(epoch: int, global_step: int, run_id: str = "") -> str:
    return f"epoch{epoch:04d}-step{global_step:08d}{f'-{run_id}' if run_id else ''}.ckpt"


def _entries(directory: Path) -> list[tuple[str, int, int, Path]]:
    """``(run id, epoch, step, path)`` of every checkpoint file in ``directory``."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match:
            found.append((match.group(3) or "", int(match.group(1)), int(match.group(2)), path))
    return found


def list_checkpoints(directory: str | Path, *, run_id: str | None = None) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first.

    With ``run_id``: that run's files by (epoch, step). Without: every run's files,
    runs ordered by when they last wrote (mtime of their newest file), so the last
    entry is the newest checkpoint of the most recent run.
    """
    runs: dict[str, list[tuple[int, int, Path]]] = {}
    for run, epoch, step, path in _entries(Path(directory)):
        if run_id is None or run == run_id:
            runs.setdefault(run, []).append((epoch, step, path))

    def recency(run: str) -> tuple[int, tuple[int, int]]:
        try:
            stamp = max(p.stat().st_mtime_ns for _, _, p in runs[run])
        except OSError:
            stamp = 0
        return stamp, max(runs[run])[:2]

    return [p for run in sorted(runs, key=recency) for _, _, p in sorted(runs[run])]


def new_run_id(directory: str | Path) -> str:
    """The id of a new run writing into ``directory``: empty (plain names) when the
    directory holds no checkpoint, a random 8-hex-digit id otherwise."""
    return secrets.token_hex(4) if _entries(Path(directory)) else ""


def resolve_resume(resume: str | Path) -> Path:
    """A checkpoint file: ``resume`` itself, or the newest one in the directory.

    Does not check the file; :func:`load_resumable` also falls back past damaged ones.
    """
    path = Path(resume)
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise BayesifyError(f"resume={str(path)!r}: the directory holds no *.ckpt checkpoint")
        return found[-1]
    if not path.is_file():
        raise BayesifyError(f"resume={str(path)!r} is neither a checkpoint file nor a directory")
    return path


def load_resumable(resume: str | Path) -> tuple[Path, dict[str, Any]]:
    """``(path, payload)`` of the checkpoint to resume from.

    A file is loaded as is (a damaged one is an error). For a directory the newest
    checkpoint that passes :func:`load_checkpoint` is used; each damaged newer
    file is skipped with a warning naming it and what was wrong, so a corrupt
    newest file costs the steps since the previous one, never a wrong state.
    """
    path = resolve_resume(resume)
    if not Path(resume).is_dir():
        return path, load_checkpoint(path)
    remove_stale_temp_files(path.parent)
    problems: list[str] = []
    for candidate in reversed(list_checkpoints(path.parent)):
        try:
            payload = load_checkpoint(candidate, hint=False)
        except BayesifyError as err:
            problems.append(str(err))
            continue
        if problems:
            warnings.warn(
                f"resuming from {candidate.name}, the newest checkpoint that passes the "
                f"integrity check; skipped {len(problems)} damaged newer one(s): "
                + " | ".join(problems), stacklevel=3,
            )
        return candidate, payload
    raise BayesifyError(
        f"resume={str(resume)!r}: no checkpoint in the directory passes the integrity check: "
        + " | ".join(problems) + ". Start a new checkpoint directory"
    )


def remove_stale_temp_files(directory: str | Path) -> list[Path]:
    """Delete ``.NAME.tmp-PID`` files of writers that no longer run; returns them.

    A writer killed between ``open`` and ``os.replace`` leaves its temp file
    behind; the PID in the name tells whether that process is still alive.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.iterdir():
        match = _TMP.fullmatch(path.name)
        if match and _NAME.fullmatch(match.group(1)) and not _writer_alive(int(match.group(2))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _writer_alive(pid: int) -> bool:
    if pid == os.getpid():  # our own writer is not running while we clean up
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError):
        return True  # exists under another user (or unknowable): leave it alone
    return True


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a fresh temp file in the same directory, fsync, ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path.parent)
    tmp = write_temp(path.parent, lambda fh: torch.save(obj, fh),
                     prefix=f".{path.name}.tmp-{os.getpid()}-", suffix="")
    try:
        replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def prune(directory: str | Path, keep: int, *, run_id: str = "") -> None:
    """Delete all but the newest ``keep`` checkpoints of run ``run_id`` (``keep <= 0``:
    keep all); other runs' files are never touched."""
    if keep <= 0:
        return
    for path in list_checkpoints(directory, run_id=run_id)[:-keep]:
        path.unlink(missing_ok=True)


def content_checksum(payload: dict[str, Any]) -> str:
    """sha256 over every entry of ``payload`` except ``"checksum"``.

    Deterministic walk of the loaded structure (dict keys in sorted order; tensors
    as dtype, shape and raw bytes; numbers by ``repr``), so it can be recomputed
    from what ``torch.load`` returns and compared with the stored value.
    """
    digest = hashlib.sha256()
    _digest(digest, {k: v for k, v in payload.items() if k != "checksum"})
    return digest.hexdigest()


def _digest(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"t{t.dtype}{tuple(value.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        digest.update(b"d" + struct.pack("<q", len(value)))
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _digest(digest, key)
            _digest(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(b"l" + struct.pack("<q", len(value)))
        for item in value:
            _digest(digest, item)
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        digest.update(b"s" + struct.pack("<q", len(raw)) + raw)
    elif value is None or isinstance(value, (bool, int, float)):
        digest.update(f"n{type(value).__name__}:{value!r};".encode())
    else:
        raise TypeError(f"a checkpoint cannot hold a {type(value).__name__} ({value!r:.60})")


def nonfinite_tensors(payload: dict[str, Any]) -> list[str]:
    """Names of floating tensors holding NaN/inf or overflowing values
    (:func:`bayesify.train.guard.unusable`) in the posterior, trainable base, buffers
    and optimiser state of a checkpoint payload (what a resumed run would use)."""
    from bayesify.train.guard import unusable_names

    bad = []
    for section in ("posterior", "base", "buffers"):
        bad += [f"{section}.{n}" for n in unusable_names((payload.get(section) or {}).items())]
    for index, entry in ((payload.get("optimizer") or {}).get("state") or {}).items():
        bad += [f"optimizer.state[{index}].{n}" for n in unusable_names(entry.items())]
    return bad


def load_checkpoint(path: str | Path, *, hint: bool = True) -> dict[str, Any]:
    """Read and verify a checkpoint; a corrupt or foreign file is a :class:`BayesifyError`.

    Verified before anything is returned: the file unpickles with
    ``weights_only=True``, format and version, the content checksum, readable
    metadata, RNG records that a generator accepts and a finite training state.
    """
    path = Path(path)
    earlier = [p.name for p in list_checkpoints(path.parent) if p != path] if hint else []
    tail = f"; earlier checkpoints there: {earlier}" if earlier else ""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only load failed" not in str(err).lower():  # a damaged pickle stream
            raise BayesifyError(f"checkpoint {str(path)!r} is corrupt or unreadable "
                                f"(UnpicklingError: {err}){tail}") from err
        # a disallowed global: torch's whole message, its code-execution warning included
        raise BayesifyError(
            f"checkpoint {str(path)!r} holds objects that a safe load refuses; bayesify never "
            f"unpickles arbitrary objects. torch.load said:\n{err}{tail}"
        ) from err
    except Exception as err:  # truncated zip, bad pickle, …
        raise BayesifyError(
            f"checkpoint {str(path)!r} is corrupt or unreadable ({type(err).__name__}: {err}){tail}"
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise BayesifyError(f"{str(path)!r} is not a bayesify training checkpoint")
    version = payload.get("version")
    if type(version) is not int or version != VERSION:
        older = " (written by an older bayesify, without a content checksum)" if version == 1 else ""
        raise BayesifyError(
            f"checkpoint {str(path)!r} has format version {version!r}{older}; this bayesify "
            f"reads version {VERSION}: start a new checkpoint directory"
        )
    try:
        actual = content_checksum(payload)
    except TypeError as err:
        raise BayesifyError(f"checkpoint {str(path)!r} is corrupt or unreadable ({err}){tail}") from err
    if payload.get("checksum") != actual:
        raise BayesifyError(
            f"checkpoint {str(path)!r} is corrupt or unreadable: its content does not match its "
            f"checksum (stored {str(payload.get('checksum'))[:16]!r}…, content "
            f"{actual[:16]}…): the file was damaged or modified after it was written{tail}"
        )
    try:
        payload["meta"] = json.loads(payload["meta"])
        if not isinstance(payload["meta"], dict):
            raise TypeError("metadata is not a JSON object")
    except (KeyError, TypeError, RecursionError, json.JSONDecodeError) as err:
        raise BayesifyError(f"checkpoint {str(path)!r} has no readable metadata ({err})") from err
    for key in ("posterior", "base", "buffers", "optimizer"):
        if not isinstance(payload.get(key), dict):
            raise BayesifyError(f"checkpoint {str(path)!r} lacks its {key!r} section{tail}")
    check_rng_records(payload.get("rng"), path)
    nonfinite = nonfinite_tensors(payload)
    if nonfinite:  # never written by bayesify; refuse rather than train on NaN
        raise BayesifyError(f"checkpoint {str(path)!r} holds NaN/inf in {nonfinite[:5]}; it is "
                            f"not a state to resume from{tail}")
    return payload


def check_rng_records(records: Any, path: str | Path) -> None:
    """Every rank's RNG record must be accepted by a scratch generator (CPU states)."""
    if not isinstance(records, list):
        raise BayesifyError(f"checkpoint {str(path)!r}: the RNG record is missing or not a list")
    cpu_size = torch.get_rng_state().numel()
    for rank, record in enumerate(records):
        if not isinstance(record, dict) or not {"cpu", "noise"} <= set(record):
            raise BayesifyError(f"checkpoint {str(path)!r}: the RNG record of rank {rank} is "
                                "malformed (expected 'cpu' and 'noise' states)")
        for key, state in record.items():
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                raise BayesifyError(f"checkpoint {str(path)!r}: RNG state {key!r} of rank {rank} "
                                    "is not a uint8 tensor")
            if key == "cuda" or state.numel() != cpu_size:
                continue  # CUDA / accelerator states are checked when they are set
            try:
                torch.Generator().set_state(state)
            except RuntimeError as err:
                raise BayesifyError(
                    f"checkpoint {str(path)!r}: the RNG record {key!r} of rank {rank} is corrupt "
                    f"({err}); resume from an earlier checkpoint"
                ) from err


def base_fingerprint(bnn: BayesianModel) -> str:
    """SHA-256 over the frozen base tensors (names, shapes, bytes).

    Trainable base tensors are saved in the checkpoint itself; the frozen ones
    are not, so resuming on a different pretrained network must be refused.
    """
    frozen = {name: p for name, p in bnn.named_base_parameters() if not p.requires_grad}
    return fingerprint(frozen)[:32]


def identity(bnn: BayesianModel) -> dict[str, Any]:
    """What must match between a checkpoint and the model it is loaded into."""
    return {
        "method": bnn.method_name,
        "config": json.loads(json.dumps(bnn.method.config.to_dict(), default=str)),
        "targets": list(bnn.targets),
        "posterior_shapes": {n: list(p.shape) for n, p in bnn.named_posterior_parameters()},
        "base_fingerprint": base_fingerprint(bnn),
    }


#: run settings recorded by :func:`bayesify.train.resume.result_options`: what each one is
#: and why a change alters the result
_SETTINGS = {
    "shuffle": ("the training loader shuffles", "the data order differs"),
    "bn_train": ("BatchNorm statistics train",
                 "the network's statistics would train in one part of the run only"),
    "val_loader": ("a validation loader is given",
                   "the validation search at the end is part of the result"),
    "shift_loader": ("a shift loader is given",
                     "the validation search uses it as its robustness signal"),
    "amp": ("bf16 autocast", "the forward's precision differs"),
}


def describe_change(key: str, saved: Any, now: Any) -> str:
    """One line naming a fit option or run setting that differs from the checkpoint."""
    if key in _SETTINGS:
        what, why = _SETTINGS[key]
        return f"{key} ({what}): {saved!r} in the checkpointed run, {now!r} now ({why})"
    return f"fit option {key}: checkpoint {saved!r}, now {now!r}"


def check_compatible(meta: dict[str, Any], current: dict[str, Any], options: dict[str, Any],
                     path: str | Path) -> None:
    """Raise a :class:`BayesifyError` naming every mismatch with the checkpoint."""
    saved = meta.get("identity", {})
    problems = []
    for key in ("method", "config", "targets", "posterior_shapes", "base_fingerprint"):
        if saved.get(key) != current[key]:
            if key == "config":
                keys = sorted(k for k in set(saved.get(key) or {}) | set(current[key])
                              if (saved.get(key) or {}).get(k) != current[key].get(k))
                problems.append(f"config differs in {keys}")
            elif key == "base_fingerprint":
                problems.append("the frozen base weights differ (another pretrained network)")
            elif key in ("targets", "posterior_shapes"):
                problems.append(f"{key} differ")
            else:
                problems.append(f"{key}: checkpoint {saved.get(key)!r}, now {current[key]!r}")
    saved_opts = meta.get("options", {})
    for key, value in options.items():
        if key in saved_opts and saved_opts[key] != value:
            problems.append(describe_change(key, saved_opts[key], value))
    if problems:
        raise BayesifyError(
            f"checkpoint {str(path)!r} does not match this run: " + "; ".join(problems)
            + ". Resume with the same model, method, config and fit options, or start a new "
            "checkpoint directory"
        )


def rng_state(noise: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG streams: global CPU, global CUDA (if used), the noise stream."""
    state = {"cpu": torch.get_rng_state(), "noise": noise.get_state().cpu()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], noise: torch.Generator, device: torch.device,
                  *, path: str | Path = "?") -> None:
    """Restore this rank's RNG streams; a state a generator refuses is a :class:`BayesifyError`."""
    try:
        noise.set_state(state["noise"])
        torch.set_rng_state(state["cpu"])
        if device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], device)
    except (RuntimeError, KeyError, TypeError) as err:
        raise BayesifyError(
            f"checkpoint {str(path)!r}: the saved RNG state is corrupt or does not fit this "
            f"device ({type(err).__name__}: {err}); resume from an earlier checkpoint"
        ) from err
