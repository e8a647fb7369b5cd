"""Conveniences of :class:`~bayesify.core.model.BayesianModel` implemented above core.

``bnn.predictor()`` and ``bnn.save_posterior()`` are implemented by
:mod:`bayesify.predict` and :mod:`bayesify.persistence`; those packages register their
implementation here when they are imported (``import bayesify`` imports both), so
core never imports a floor above it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bayesify.errors import BayesifyError

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}


def provide(name: str, implementation: Callable[..., Any]) -> None:
    """Register the implementation of the convenience ``name`` (called at import)."""
    _IMPLEMENTATIONS[name] = implementation


def implementation(name: str) -> Callable[..., Any]:
    """The registered implementation of ``name``; an error naming the module to import."""
    try:
        return _IMPLEMENTATIONS[name]
    except KeyError:
        raise BayesifyError(
            f"BayesianModel.{name} is provided by a bayesify package that was not imported; "
            "`import bayesify` (or bayesify.predict / bayesify.persistence) first"
        ) from None
