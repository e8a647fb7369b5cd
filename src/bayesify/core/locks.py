"""One re-entrant lock per model object, kept outside the module.

A prediction mutates state every layer of one model shares (the sampling plan of
its :class:`~bayesify.core.context.SamplingContext`, train/eval modes, family
caches), so concurrent predictions on one model must take turns. The locks live
in a weak dictionary rather than on the module so that models stay deep-copyable
and picklable (a lock is neither) and vanish with their model.

**Forks.** ``os.fork()`` copies every lock in the state it had, but only the
forking thread: a lock another thread held at that moment would stay held forever
in the child (pre-fork servers such as gunicorn, DataLoader workers started with
``fork``). The child therefore starts with a fresh table (``os.register_at_fork``):
its first prediction takes a new, free lock. The forking thread's own ``with``
blocks release the old objects they hold, which no one else in the child uses.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["model_lock"]

_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> threading.RLock:
    """The re-entrant lock of ``model`` (one per object, created on first use)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def _reset_after_fork() -> None:
    """In a forked child: new, free locks for every model (see the module docstring)."""
    global _LOCKS, _LOCKS_GUARD
    _LOCKS_GUARD = threading.Lock()
    _LOCKS = weakref.WeakKeyDictionary()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_reset_after_fork)
