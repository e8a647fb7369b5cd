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

A save never overwrites a ``bayesify.json`` that is not a bayesify posterior manifest
(:func:`commit_posterior` refuses the directory), and the cleanup of step 1 deletes
only temporary files whose names carry :mod:`bayesify.atomic_files`' marker.

Reads are bounded: a tensor file (or pending candidate) whose size differs from the
manifest's ``posterior_bytes``, or whose safetensors header does not account for
exactly its size, is refused before its data is read; the data is then read once in
blocks while it is hashed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bayesify.atomic_files import (
    directory_lock,
    file_sha256,
    fsync_directory,
    is_own_temp,
    replace,
    write_temp,
)
from bayesify.errors import BayesifyError
from bayesify.posterior_format import (
    FORMAT,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    TENSOR_FILE,
    header_extent,
    read_manifest,
)

__all__ = ["commit_posterior", "move_posterior", "read_committed"]

#: prefixes of this module's temporary files (suffixes ``.safetensors`` / ``.json.tmp``)
_PENDING_PREFIX = re.compile(r"\.posterior-[0-9a-f]{16}-")
_MANIFEST_PREFIX = ".bayesify-"
#: times a loader re-reads the manifest when a concurrent save replaced the files
_READ_ATTEMPTS = 4
#: a safetensors header larger than this is not a posterior's
MAX_HEADER_BYTES = 100 << 20

#: called with ``(header, path)`` before a tensor file's data is read; raises to refuse it
HeaderCheck = Callable[[dict[str, tuple[str, tuple[int, ...]]], Path], None]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_temporary(name: str) -> bool:
    return (is_own_temp(name, _PENDING_PREFIX, ".safetensors")
            or is_own_temp(name, _MANIFEST_PREFIX, ".json.tmp"))


def _pending(directory: Path, sha: str) -> list[Path]:
    return sorted(directory.glob(f".posterior-{sha[:16]}-*.safetensors"))


def _refuse_foreign_manifest(directory: Path) -> None:
    """A regular ``bayesify.json`` that is not a posterior manifest belongs to someone
    else: refuse the directory instead of overwriting it (a symlink there is replaced,
    never written through)."""
    path = directory / MANIFEST_FILE
    if path.is_symlink() or not path.exists():
        return
    try:
        ours = path.is_file() and path.stat().st_size <= MAX_MANIFEST_BYTES and (
            json.loads(path.read_bytes()).get("format") == FORMAT)
    except (OSError, ValueError, AttributeError, RecursionError):
        ours = False
    if not ours:
        raise BayesifyError(
            f"{directory} holds a {MANIFEST_FILE} that is not a bayesify posterior manifest; "
            "refusing to overwrite it. Save into an empty directory (or one holding a saved "
            f"posterior), or move that {MANIFEST_FILE} away first")


def _committed_sha(directory: Path) -> str | None:
    try:
        sha = json.loads((directory / MANIFEST_FILE).read_text())["posterior_sha256"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return sha if isinstance(sha, str) else None


def _settle(directory: Path) -> None:
    """Finish a commit killed between steps 3 and 4, then remove every temporary file
    (under the lock, none belongs to a live writer)."""
    leftovers = [p for p in directory.iterdir() if _is_temporary(p.name)]
    if not leftovers:
        return
    sha = _committed_sha(directory)
    tensor_path = directory / TENSOR_FILE
    # hashed in blocks: never whole in memory
    if sha is not None and _pending(directory, sha) and file_sha256(tensor_path) != sha:
        for candidate in _pending(directory, sha):
            if _is_temporary(candidate.name) and file_sha256(candidate) == sha:
                replace(candidate, tensor_path)
                break
    for path in leftovers:
        path.unlink(missing_ok=True)


def commit_posterior(directory: Path, tensor_bytes: bytes, manifest_bytes: bytes) -> None:
    """Steps 1–4 of the module docstring for one save into ``directory``."""
    with directory_lock(directory):
        _refuse_foreign_manifest(directory)
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


def _read_checked(path: Path, manifest: dict[str, Any],
                  check_header: HeaderCheck | None) -> bytes | None:
    """The bytes of ``path`` if they hash to the manifest's sha256, ``None`` if they do
    not. Refused before the data is read (:class:`BayesifyError`): a size other than the
    manifest's ``posterior_bytes``, a safetensors header that does not account for
    exactly the file's size, or one ``check_header`` refuses."""
    sha, recorded = manifest["posterior_sha256"], manifest.get("posterior_bytes")
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if recorded is not None and size != recorded:
            raise BayesifyError(
                f"{path} is {size} bytes but {MANIFEST_FILE} records {recorded}: it is not the "
                "saved tensor file (replaced, truncated or padded); refused before reading it")
        start = fh.read(8)
        length = int.from_bytes(start, "little") if len(start) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise BayesifyError(f"{path} is not a safetensors file of a posterior: its header "
                                f"length {length} does not fit the {size}-byte file")
        head = start + fh.read(length)
        header, extent = header_extent(head, path, file_size=size)
        if extent != size:
            raise BayesifyError(
                f"{path} is {size} bytes but its header describes {extent}: the file was "
                "padded or truncated; refused before reading its data")
        if check_header is not None:
            check_header(header, path)
        data = bytearray(size)
        data[: len(head)] = head
        view, offset = memoryview(data), len(head)
        while offset < size:
            got = fh.readinto(view[offset: offset + (1 << 24)])
            if not got:
                return None  # shrank while being read (a concurrent save): look again
            offset += got
    return bytes(data) if _sha256(data) == sha else None


def _tensor_bytes(directory: Path, manifest: dict[str, Any],
                  check_header: HeaderCheck | None) -> tuple[bytes | None, Path, str]:
    """The committed tensor file's bytes (verified against the manifest's sha256), its
    path, or the reason it could not be found."""
    tensor_path = directory / TENSOR_FILE
    problem = f"{tensor_path} is missing; the saved posterior is incomplete"
    mismatch = (f"{tensor_path} does not match the sha256 recorded in {MANIFEST_FILE}: "
                "the tensor file was modified or replaced")
    # the pending file may be renamed into place while we look: the committed file twice
    for index, path in enumerate([tensor_path, *_pending(directory, manifest["posterior_sha256"]),
                                  tensor_path]):
        if not path.is_file():
            continue
        try:
            data = _read_checked(path, manifest, check_header)
        except FileNotFoundError:
            continue
        except BayesifyError as err:
            if index == 0:
                problem = str(err)
            continue
        if data is not None:
            return data, path, ""
        if index == 0:
            problem = mismatch
    return None, tensor_path, problem


def read_committed(directory: str | Path, *, check_header: HeaderCheck | None = None,
                   ) -> tuple[dict[str, Any], bytes, Path]:
    """``(checked manifest, tensor file bytes, path)`` of the committed posterior.

    Sizes are checked before any data is read (module docstring) and ``check_header``
    (e.g. the shapes a dry run of the manifest's config implies) sees the header first;
    the bytes are read once and verified against the manifest's sha256, so what is
    parsed later is exactly what was checked.
    """
    directory = Path(directory)
    problem = ""
    for _ in range(_READ_ATTEMPTS):
        # a saver may rename the pending file onto posterior.safetensors (or commit a newer
        # manifest) between our reads: look again before calling the directory damaged
        manifest = read_manifest(directory)
        data, path, problem = _tensor_bytes(directory, manifest, check_header)
        if data is not None:
            return manifest, data, path
    raise BayesifyError(problem)
