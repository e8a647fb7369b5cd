"""The one atomic commit of a saved posterior, and reading back the committed pair.

A posterior directory holds ``bayesify.json`` (the manifest, with the sha256 of
its tensor file) and ``posterior.safetensors``. Two files cannot be renamed at
once, so the manifest is the commit point and the tensor file it names is
always present under a name the loader finds:

1. (under an exclusive lock on the directory) finish an interrupted earlier
   commit and delete temporary files of killed writers;
2. write the new tensors to ``.posterior-<sha16>-<random>.safetensors`` and the
   new manifest to ``.bayesify-<random>.json.tmp`` (fresh ``O_EXCL`` names,
   fsync'ed) — everything that can fail (JSON encoding, validation) has already
   happened in memory;
3. ``os.replace`` the manifest onto ``bayesify.json`` — **the commit**;
4. ``os.replace`` the pending tensor file onto ``posterior.safetensors``.

A kill before 3 leaves the previous manifest and its tensor file untouched; a
kill between 3 and 4 leaves the new manifest whose tensors wait in the pending
file, which :func:`read_committed` finds by the sha prefix and verifies (and the
next save renames into place). Concurrent savers take turns on the lock (POSIX);
a loader racing a saver re-reads the manifest when its tensor file was replaced
underneath it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from bayesify.atomic_files import directory_lock, fsync_directory, replace, write_temp
from bayesify.errors import BayesifyError
from bayesify.posterior_format import MANIFEST_FILE, TENSOR_FILE, read_manifest

__all__ = ["commit_posterior", "move_posterior", "read_committed"]

#: temporary files of this module (and the fixed names older versions used)
_TEMPORARY = re.compile(r"\.posterior-[0-9a-f]{16}-.+\.safetensors|\.bayesify-.+\.json\.tmp"
                        r"|\.bayesify\.json\.tmp|\.posterior\.safetensors\.tmp")
#: times a loader re-reads the manifest when a concurrent save replaced the files
_READ_ATTEMPTS = 4


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pending(directory: Path, sha: str) -> list[Path]:
    return sorted(directory.glob(f".posterior-{sha[:16]}-*.safetensors"))


def _committed_sha(directory: Path) -> str | None:
    try:
        sha = json.loads((directory / MANIFEST_FILE).read_text())["posterior_sha256"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return sha if isinstance(sha, str) else None


def _settle(directory: Path) -> None:
    """Finish a commit killed between steps 3 and 4, then remove every temporary file
    (under the lock, none belongs to a live writer)."""
    leftovers = [p for p in directory.iterdir() if _TEMPORARY.fullmatch(p.name)]
    if not leftovers:
        return
    sha = _committed_sha(directory)
    tensor_path = directory / TENSOR_FILE
    if sha is not None and _pending(directory, sha):
        current = tensor_path.read_bytes() if tensor_path.is_file() else b""
        if _sha256(current) != sha:
            for candidate in _pending(directory, sha):
                if _sha256(candidate.read_bytes()) == sha:
                    replace(candidate, tensor_path)
                    break
    for path in leftovers:
        path.unlink(missing_ok=True)


def commit_posterior(directory: Path, tensor_bytes: bytes, manifest_bytes: bytes) -> None:
    """Steps 1–4 of the module docstring for one save into ``directory``."""
    with directory_lock(directory):
        _settle(directory)
        sha = _sha256(tensor_bytes)
        pending = write_temp(directory, tensor_bytes, prefix=f".posterior-{sha[:16]}-",
                             suffix=".safetensors")
        staged: Path | None = None
        try:
            staged = write_temp(directory, manifest_bytes, prefix=".bayesify-",
                                suffix=".json.tmp")
            fsync_directory(directory)
            replace(staged, directory / MANIFEST_FILE)  # the commit
        except BaseException:
            if staged is not None:
                staged.unlink(missing_ok=True)
            if not _is_committed(directory, manifest_bytes):
                pending.unlink(missing_ok=True)
            raise
        replace(pending, directory / TENSOR_FILE)


def _is_committed(directory: Path, manifest_bytes: bytes) -> bool:
    try:
        return (directory / MANIFEST_FILE).read_bytes() == manifest_bytes
    except OSError:
        return False


def move_posterior(source: Path, target: Path) -> None:
    """Commit the posterior saved in ``source`` into ``target`` atomically (used to move
    a staged run directory into place), then remove it from ``source``."""
    tensors, manifest = source / TENSOR_FILE, source / MANIFEST_FILE
    target.mkdir(parents=True, exist_ok=True)
    commit_posterior(target, tensors.read_bytes(), manifest.read_bytes())
    tensors.unlink()
    manifest.unlink()


def _tensor_bytes(directory: Path, sha: str) -> tuple[bytes | None, Path, str]:
    """The committed tensor file's bytes (verified against ``sha``), its path, or the
    reason it could not be found."""
    tensor_path = directory / TENSOR_FILE
    problem = f"{tensor_path} is missing; the saved posterior is incomplete"
    if tensor_path.is_file():
        data = tensor_path.read_bytes()
        if _sha256(data) == sha:
            return data, tensor_path, ""
        problem = (f"{tensor_path} does not match the sha256 recorded in {MANIFEST_FILE}: "
                   "the tensor file was modified or replaced")
    for candidate in _pending(directory, sha):
        try:
            data = candidate.read_bytes()
        except OSError:
            continue
        if _sha256(data) == sha:
            return data, candidate, ""
    if tensor_path.is_file():  # the pending file may have been renamed into place meanwhile
        data = tensor_path.read_bytes()
        if _sha256(data) == sha:
            return data, tensor_path, ""
    return None, tensor_path, problem


def read_committed(directory: str | Path) -> tuple[dict[str, Any], bytes, Path]:
    """``(checked manifest, tensor file bytes, path)`` of the committed posterior.

    The bytes are read once and verified against the manifest's sha256, so what is
    parsed later is exactly what was checked.
    """
    directory = Path(directory)
    problem = ""
    for _ in range(_READ_ATTEMPTS):
        # a saver may rename the pending file onto posterior.safetensors (or commit a newer
        # manifest) between our reads: look again before calling the directory damaged
        manifest = read_manifest(directory)
        data, path, problem = _tensor_bytes(directory, manifest["posterior_sha256"])
        if data is not None:
            return manifest, data, path
    raise BayesifyError(problem)
