"""Crash-safe file writes shared by posterior saves and training checkpoints.

- :func:`write_temp`: bytes (or a writer) into a *fresh, randomly named* file
  created with ``O_EXCL | O_NOFOLLOW`` in the target directory, flushed and
  fsync'ed. No fixed temporary name is ever used, so a symlink planted at a
  predictable name cannot redirect a write, and two writers never share a file.
  The name carries a marker (``<random 16 hex><tag 8 hex>`` with the tag a digest of
  prefix and random part): :func:`is_own_temp` tells a leftover of a killed writer
  from a user's file that merely looks like one, so cleanups delete only their own.
- :func:`replace`: ``os.replace`` + fsync of the directory (the rename is durable).
  Renaming onto a symlink replaces the link itself, never its target.
- :func:`directory_lock`: an exclusive ``flock`` on the directory itself (no lock
  file), so concurrent savers in threads or processes take turns; the kernel
  drops it when a holder dies. Where ``fcntl`` does not exist (Windows) it is a
  no-op and concurrent savers are not serialised.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["directory_lock", "file_sha256", "fsync_directory", "is_own_temp", "replace",
           "write_temp"]

_MARKED = re.compile(r"(?P<prefix>.*)(?P<random>[0-9a-f]{16})(?P<tag>[0-9a-f]{8})")


def _tag(prefix: str, random: str) -> str:
    return hashlib.sha256(f"bayesify-temporary|{prefix}|{random}".encode()).hexdigest()[:8]


def _marked_name(prefix: str, suffix: str) -> str:
    random = secrets.token_hex(8)
    return f"{prefix}{random}{_tag(prefix, random)}{suffix}"


def is_own_temp(name: str, prefix: str | re.Pattern[str], suffix: str) -> bool:
    """Whether ``name`` is a temporary file :func:`write_temp` made with this ``suffix``
    and a prefix matching ``prefix`` (a literal or a pattern): the marker in the name
    must check out, so a user's ``.bayesify-notes.json.tmp`` is never taken for one."""
    if not name.endswith(suffix):
        return False
    found = _MARKED.fullmatch(name[: len(name) - len(suffix)])
    if found is None or found["tag"] != _tag(found["prefix"], found["random"]):
        return False
    if isinstance(prefix, str):
        return found["prefix"] == prefix
    return prefix.fullmatch(found["prefix"]) is not None


def file_sha256(path: str | os.PathLike, *, limit: int | None = None) -> str | None:
    """sha256 of a file read in 1 MiB blocks (never whole in memory); ``None`` when it
    cannot be read, is not a regular file or is larger than ``limit`` bytes."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            if not os.path.isfile(path) or (limit is not None
                                            and os.fstat(fh.fileno()).st_size > limit):
                return None
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make renames inside ``directory`` durable (best effort where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_temp(directory: str | os.PathLike, data: bytes | Callable[[IO[bytes]], None], *,
               prefix: str, suffix: str = ".tmp") -> Path:
    """A new file ``directory/PREFIX<random><tag>SUFFIX`` holding ``data``, fsync'ed.

    Created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name (like
    ``tempfile.mkstemp``, but with the usual ``0o666 & ~umask`` permissions, so a
    saved posterior is as readable as any other file). ``data`` is bytes or a
    function writing into the open binary file. Removed again if writing fails.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_BINARY", 0)
    for _ in range(100):
        path = Path(directory) / _marked_name(prefix, suffix)
        try:
            fd = os.open(path, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - 100 collisions of 64 random bits
        raise FileExistsError(f"no free temporary name in {directory}")
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def replace(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Atomically rename ``source`` onto ``target`` and fsync the directory."""
    os.replace(source, target)
    fsync_directory(Path(target).parent)


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike, *, shared: bool = False,
                   missing_ok: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (``flock`` on the directory's own fd) — or,
    ``shared=True``, a shared one: readers hold it together, a writer waits for them and
    they for it. ``missing_ok``: a directory that cannot be opened is not locked (the
    caller's own read then says what is wrong)."""
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        if not missing_ok:
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
