"""Progress bars and timed log lines of the library's long phases.

Every phase that can take more than a few seconds (training epochs, validation,
``evaluate``, ``calibrate``, the knob search) iterates through :func:`progress_bar`:
a ``tqdm`` bar that disappears when done (``leave=False``), shown only on rank 0
under ``torchrun`` and never when the caller passes ``progress=False``. Phases
without batches (export, resume) say what they did through :mod:`logging` — every
module logs to ``logging.getLogger(__name__)``, a child of ``"bayesify"``, so a handler
on ``"bayesify"`` at INFO shows them (the README's lines; ``logging.basicConfig`` at INFO
would show every other library's INFO lines too).

Off a terminal (``sys.stderr`` is no TTY: CI logs, ``2> file``, a pipe) a bar's
carriage-return frames would fill the log, so :func:`progress_bar` returns
:class:`PhaseLines` instead: the phase as a few INFO lines on ``bayesify.progress`` —
one every :data:`LINE_EVERY_S` seconds while it runs and one when it ends (count, seconds,
the last postfix). Notebooks keep their widget bar.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist


def is_rank_zero() -> bool:
    """Rank 0 of an initialised process group, or of ``torchrun``'s ``RANK`` before one
    exists (a single process is rank 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


#: seconds between two progress lines of one phase off a terminal
LINE_EVERY_S = 30.0
logger = logging.getLogger(__name__)


def _terminal_or_notebook() -> bool:
    """Whether a bar can redraw in place: ``sys.stderr`` is a TTY, or ``tqdm.auto`` picked
    the notebook widget (an IPython kernel)."""
    from tqdm.auto import tqdm as auto_tqdm

    if any(cls.__module__ == "tqdm.notebook" for cls in auto_tqdm.__mro__):
        return True
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # no stream, or a closed one
        return False


class PhaseLines:
    """A bar's interface (iteration, ``update``, ``set_postfix``, ``close``) that writes a
    few log lines instead of frames: ``"<desc>: k/N (s s)"`` at most every
    :data:`LINE_EVERY_S` seconds and ``"<desc>: k/N done in s s; postfix"`` at the end."""

    def __init__(self, iterable: Iterable | None, desc: str, *, total: int | None,
                 initial: int = 0, enabled: bool = True) -> None:
        self.iterable, self.desc, self.enabled = iterable, desc, enabled
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.n, self.postfix = total, initial, ""
        self.start = self.last = time.perf_counter()
        self.closed = False

    @property
    def disable(self) -> bool:
        """tqdm's attribute: whether this phase reports at all (rank 0 and asked for)."""
        return not self.enabled

    def __len__(self) -> int:
        return self.total or 0

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def _count(self) -> str:
        return f"{self.n}/{self.total}" if self.total else str(self.n)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.enabled and now - self.last >= LINE_EVERY_S:
            self.last = now
            logger.info("%s: %s (%.0f s)", self.desc, self._count(), now - self.start)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.enabled:
            extra = f"; {self.postfix}" if self.postfix else ""
            logger.info("%s: %s done in %.1f s%s", self.desc, self._count(),
                        time.perf_counter() - self.start, extra)


def progress_bar(iterable: Iterable | None, desc: str, *, enabled: bool = True,
                 total: int | None = None, initial: int = 0) -> Any:
    """``iterable`` behind a ``tqdm`` bar (``leave=False``; ``None`` with ``total``: a bar
    advanced by hand with ``update``): off when ``enabled`` is false and on every rank but 0.
    Off a terminal: :class:`PhaseLines` (log lines, no carriage-return frames)."""
    from tqdm.auto import tqdm

    shown = enabled and is_rank_zero()
    if shown and not _terminal_or_notebook():
        return PhaseLines(iterable, desc, total=total, initial=initial)
    return tqdm(iterable, desc=desc, total=total, initial=initial, disable=not shown,
                leave=False, dynamic_ncols=True)


@contextmanager
def timed(logger: logging.Logger, what: str) -> Iterator[dict[str, Any]]:
    """Log ``what`` at INFO before and ``what: done in S s`` after (rank 0); the yielded
    dict's ``"result"`` is appended to the second line when the body sets it."""
    note: dict[str, Any] = {}
    loud = is_rank_zero()
    if loud:
        logger.info("%s ...", what)
    start = time.perf_counter()
    yield note
    if loud:
        extra = f"; {note['result']}" if note.get("result") else ""
        logger.info("%s: done in %.1f s%s", what, time.perf_counter() - start, extra)
