"""Per-model state: saved posterior state (buffers) and a runtime (never saved) cache.

Whatever a family needs per model lives here or in its layers, never on the method
object (one method object describes a family's structure; it holds no model data).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class PosteriorState(nn.Module):
    """Family-level posterior state held as buffers (e.g. SWAG's covariance scale,
    Laplace's training loss, the predictive temperature), saved and loaded with the
    posterior and checkpoints like every other buffer. Families register entries in
    ``Method.prepare`` with fixed shapes, so loading is strict."""

    def add(self, name: str, value: torch.Tensor) -> None:
        self.register_buffer(name, value.detach().clone())

    def set(self, name: str, value: torch.Tensor | float) -> None:
        buffer = self.get_buffer(name)
        buffer.copy_(torch.as_tensor(value, dtype=buffer.dtype).reshape(buffer.shape))

    def value(self, name: str) -> float:
        return float(self.get_buffer(name).reshape(-1)[0])


#: keys of ``bnn.runtime`` entries derived from the posterior state (:func:`derived`)
_DERIVED: set[str] = set()


def derived(key: str) -> str:
    """Register ``key`` as a ``bnn.runtime`` entry computed from the posterior state (an
    eigendecomposition of a curvature, recomputed BatchNorm statistics of sampled networks):
    it is dropped whenever state is loaded into the model (:meth:`RuntimeCache.forget_derived`),
    so a prediction never reads what an earlier state left. Returns ``key``."""
    _DERIVED.add(key)
    return key


class RuntimeCache(dict):
    """``bnn.runtime``: per-model values that are not posterior state and are never saved,
    checkpointed, copied or pickled — caches derived from the state (a posterior view,
    recomputed BatchNorm statistics; keys registered with :func:`derived`) and sources of
    data a predictive may need (SWAG's BatchNorm batches). A deep copy or unpickled model
    starts with an empty cache."""

    def __deepcopy__(self, memo: dict[int, Any]) -> RuntimeCache:
        return RuntimeCache()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (RuntimeCache, ())

    def forget_derived(self) -> None:
        """Drop every entry derived from the state (the state was replaced)."""
        for key in _DERIVED & set(self):
            del self[key]


def forget_derived_on_load(module: nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict`` post-hook of a Bayesian model: the loaded state replaces the one
    its runtime caches were computed from. (Keep-best put a kept state back after searching
    the start, heads included, and the heads' cached eigendecomposition stayed the start's:
    mean-field on the ViT protocol's seed 1 predicted 0.0066 nats off its own state.)"""
    runtime = getattr(module, "runtime", None)
    if isinstance(runtime, RuntimeCache):
        runtime.forget_derived()
