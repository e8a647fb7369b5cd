"""The name ``bayesify`` in every spelling a user tries.

``bayesify`` is the package, the factory function and the verb; each of these
works and means the same thing::

    import bayesify as bz;          bz.bayesify(model);  bz.fit(...)
    import bayesify;                bayesify(model)      # the package is callable
    from bayesify import bayesify;  bayesify(model);     bayesify.load_posterior(...)

The package's class becomes :class:`CallablePackage` (a ``ModuleType`` whose call
is the factory) and ``bayesify.bayesify`` is a :class:`BayesifyEntry`: the factory,
whose attributes are the package's (``fit``, ``load_posterior``, ``elbo_loss``,
``tune``, ``predict``, ``__version__``, ...), so ``from bayesify import bayesify``
never hides the rest of the API.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any


def first_doc_line(obj: Any) -> str:
    """The first line of ``obj``'s own docstring ('' for a dataclass's generated one)."""
    doc = (obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__) or ""
    line = doc.strip().splitlines()[0].strip() if doc.strip() else ""
    name = getattr(obj, "__name__", "")
    return "" if name and line.startswith(f"{name}(") else line


def _package_attribute(package: types.ModuleType, name: str) -> Any:
    """``package.name``, importing the submodule ``package.name`` when there is one."""
    try:
        return getattr(package, name)
    except AttributeError:
        pass
    try:
        return importlib.import_module(f"{package.__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{package.__name__}.{name}":
            raise
    raise AttributeError(f"module {package.__name__!r} has no attribute {name!r}")


class BayesifyEntry:
    """The factory ``bayesify(model, method=..., **options)`` that also carries the
    package's public names as attributes (see the module docstring)."""

    def __init__(self, factory: Callable[..., Any], package: types.ModuleType) -> None:
        functools.update_wrapper(self, factory)
        object.__setattr__(self, "_package", package)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") and name != "__version__":
            raise AttributeError(name)
        if name == "bayesify":
            return self
        return _package_attribute(self.__dict__["_package"], name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.__dict__["_package"])))

    def __repr__(self) -> str:
        return "<function bayesify(model, method='ibnn', **options) (also the bayesify API)>"


class CallablePackage(types.ModuleType):
    """The ``bayesify`` package: a module whose call is the factory."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.bayesify(*args, **kwargs)
