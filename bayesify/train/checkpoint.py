"""Atomic training checkpoints and their validation on resume.

A checkpoint is one ``torch.save`` file holding only tensors, numbers, strings,
lists and dicts, loaded back with ``torch.load(weights_only=True)`` (nothing is
ever unpickled). Layout::

    {"format": "bayesify-checkpoint", "version": 1,
     "meta": JSON string (method, config, targets, fit options, epoch, step, history…),
     "posterior": {name: tensor}, "base": {trainable base name: tensor},
     "buffers": {name: tensor}, "optimizer": optimizer.state_dict(),
     "rng": [per rank {"cpu": uint8, "cuda": uint8?, "noise": uint8}]}

Files are ``epoch{E:04d}-step{S:08d}.ckpt`` (E = completed epochs, S = optimiser
steps) in the checkpoint directory. Writing goes to a temporary file in the same
directory, is fsync'ed and then ``os.replace``'d into place, so a failed or
interrupted write never touches an earlier checkpoint; older files are pruned
only after the new one is committed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bayesify.errors import BayesifyError
from bayesify.persistence import fingerprint

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

FORMAT = "bayesify-checkpoint"
VERSION = 1
_NAME = re.compile(r"epoch(\d{4,})-step(\d{8,})\.ckpt")


def checkpoint_name(epoch: int, global_step: int) -> str:
    return f"epoch{epoch:04d}-step{global_step:08d}.ckpt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (by epoch, then step)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match:
            found.append(((int(match.group(1)), int(match.group(2))), path))
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str | Path) -> Path:
    """A checkpoint file: ``resume`` itself, or the newest one in the directory."""
    path = Path(resume)
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise BayesifyError(f"resume={str(path)!r}: the directory holds no *.ckpt checkpoint")
        return found[-1]
    if not path.is_file():
        raise BayesifyError(f"resume={str(path)!r} is neither a checkpoint file nor a directory")
    return path


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temp file in the same directory, fsync, ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def prune(directory: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (``keep <= 0``: keep all)."""
    if keep <= 0:
        return
    for path in list_checkpoints(directory)[:-keep]:
        path.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint safely; a corrupt or foreign file is a :class:`BayesifyError`."""
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, disallowed global, …
        earlier = [p.name for p in list_checkpoints(path.parent) if p != path]
        hint = f"; earlier checkpoints there: {earlier}" if earlier else ""
        raise BayesifyError(
            f"checkpoint {str(path)!r} is corrupt or unreadable ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else ''}){hint}"
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise BayesifyError(f"{str(path)!r} is not a bayesify training checkpoint")
    if payload.get("version") != VERSION:
        raise BayesifyError(
            f"checkpoint {str(path)!r} has format version {payload.get('version')}; "
            f"this bayesify reads version {VERSION}"
        )
    try:
        payload["meta"] = json.loads(payload["meta"])
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise BayesifyError(f"checkpoint {str(path)!r} has no readable metadata") from err
    return payload


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
        "config": json.loads(json.dumps(bnn.config.to_dict(), default=str)),
        "targets": list(bnn.targets),
        "posterior_shapes": {n: list(p.shape) for n, p in bnn.named_posterior_parameters()},
        "base_fingerprint": base_fingerprint(bnn),
    }


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
            problems.append(f"fit option {key}: checkpoint {saved_opts[key]!r}, now {value!r}")
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


def set_rng_state(state: dict[str, torch.Tensor], noise: torch.Generator, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    noise.set_state(state["noise"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
