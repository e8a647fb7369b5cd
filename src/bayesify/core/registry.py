"""Registry of posterior families: name → ``module:Class`` (imported lazily).

Adding a family = adding a folder under ``bayesify/methods`` and one line here.
"""

from __future__ import annotations

import importlib

from bayesify.core.method import Method
from bayesify.errors import BayesifyError

_METHODS: dict[str, str] = {
    "ibnn": "bayesify.methods.ibnn.method:IBNNMethod",
    # registry lines of further families go below this one
    "meanfield": "bayesify.methods.meanfield.method:MeanFieldMethod",
    "mnf": "bayesify.methods.mnf.method:MNFMethod",
    "hypernet": "bayesify.methods.hypernet.method:HypernetMethod",
    "swag": "bayesify.methods.swag.method:SWAGMethod",
    "laplace": "bayesify.methods.laplace.method:LaplaceMethod",
    "rank1": "bayesify.methods.rank1.method:Rank1Method",
    "batchensemble": "bayesify.methods.batchensemble.method:BatchEnsembleMethod",
    "dropout": "bayesify.methods.dropout.method:DropoutMethod",
    "ensemble": "bayesify.methods.ensemble.method:EnsembleMethod",
    "abnn": "bayesify.methods.abnn.method:ABNNMethod",
    "epinet": "bayesify.methods.epinet.method:EpinetMethod",
}


def register_method(name: str, target: str | type[Method]) -> None:
    """Register a family under ``name`` (a class or a ``module:Class`` path)."""
    if isinstance(target, type):
        target = f"{target.__module__}:{target.__qualname__}"
    _METHODS[name] = target


def list_methods() -> list[str]:
    """Names of every registered posterior family."""
    return sorted(_METHODS)


def get_method_class(name: str) -> type[Method]:
    if not isinstance(name, str) or name not in _METHODS:
        raise BayesifyError(
            f"unknown method {name!r}; available methods: {', '.join(list_methods())}"
        )
    module_name, _, cls_name = _METHODS[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)
