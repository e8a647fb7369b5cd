"""One re-entrant lock per model object, kept outside the module.

A prediction mutates state every layer of one model shares (the sampling plan of
its :class:`~bayesify.core.context.SamplingContext`, train/eval modes, family
caches), so concurrent predictions on one model must take turns. The locks live
in a weak dictionary rather than on the module so that models stay deep-copyable
and picklable (a lock is neither) and vanish with their model.
"""

from __future__ import annotations

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
