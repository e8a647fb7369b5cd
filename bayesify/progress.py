"""Progress bars and timed log lines of the library's long phases.

Every phase that can take more than a few seconds (training epochs, validation,
``evaluate``, ``calibrate``, the knob search) iterates through :func:`progress_bar`:
a ``tqdm`` bar that disappears when done (``leave=False``), shown only on rank 0
under ``torchrun`` and never when the caller passes ``progress=False``. Phases
without batches (export, resume) say what they did through :mod:`logging` — every
module logs to ``logging.getLogger(__name__)``, a child of ``"bayesify"``, so a handler
on ``"bayesify"`` at INFO shows them (the README's lines; ``logging.basicConfig`` at INFO
would show every other library's INFO lines too).
"""

from __future__ import annotations

import logging
import os
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


def progress_bar(iterable: Iterable | None, desc: str, *, enabled: bool = True,
                 total: int | None = None) -> Any:
    """``iterable`` behind a ``tqdm`` bar (``leave=False``; ``None`` with ``total``: a bar
    advanced by hand with ``update``): off when ``enabled`` is false and on every rank but 0."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=not (enabled and is_rank_zero()),
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
