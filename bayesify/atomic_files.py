"""Crash-safe file writes shared by posterior saves and training checkpoints.

- :func:`write_temp`: bytes (or a writer) into a *fresh, randomly named* file
  created with ``O_EXCL | O_NOFOLLOW`` in the target directory, flushed and
  fsync'ed. No fixed temporary name is ever used, so a symlink planted at a
  predictable name cannot redirect a write, and two writers never share a file.
- :func:`replace`: ``os.replace`` + fsync of the directory (the rename is durable).
  Renaming onto a symlink replaces the link itself, never its target.
- :func:`directory_lock`: an exclusive ``flock`` on the directory itself (no lock
  file), so concurrent savers in threads or processes take turns; the kernel
  drops it when a holder dies. Where ``fcntl`` does not exist (Windows) it is a
  no-op and concurrent savers are not serialised.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["directory_lock", "fsync_directory", "replace", "write_temp"]

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
    """A new file ``directory/PREFIX<random>SUFFIX`` holding ``data``, fsync'ed.

    Created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name (like
    ``tempfile.mkstemp``, but with the usual ``0o666 & ~umask`` permissions, so a
    saved posterior is as readable as any other file). ``data`` is bytes or a
    function writing into the open binary file. Removed again if writing fails.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_BINARY", 0)
    for _ in range(100):
        path = Path(directory) / f"{prefix}{secrets.token_hex(8)}{suffix}"
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
def directory_lock(directory: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (``flock`` on the directory's own fd)."""
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
