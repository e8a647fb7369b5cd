"""Configuration base shared by every posterior family.

Each family defines a frozen dataclass deriving from :class:`MethodConfig`; every
field carries a ``help`` text (``field(metadata={"help": ...})``) that the CLI and
``describe_config`` show.


Every config is also checked generically against its field types before the
family's own ``validate`` runs (:func:`check_field_types`): a ``bool`` is not an
``int``, a string is not a number, floats must be finite, counts
(``components``, ``*samples``) and prior scales (``prior*_std``,
``prior_precision``, ``mixture_std*``) must be > 0, and tuples have the declared length and
element types. Messages name the family and the option.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

from bayesify.errors import BayesifyError


def option(default: Any, help: str) -> Any:
    """A dataclass field with a help text (tuples/lists become immutable defaults)."""
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={"help": help})


#: help of the ``laplace_heads`` option (on by default in the families that have them)
LAPLACE_HEADS_HELP = (
    "Member-wise last-layer Laplace heads (bayesify.kit.laplace_heads): with a val_loader, "
    "after the family's own search fit looks at the first 10,000 training examples once and "
    "puts a Laplace around every posterior component's classifier; the predictive is the "
    "mixture of the members' probit GLM predictives, whose spread grows off the data, with "
    "the heads' τ and the temperature (sharpening included) chosen on validation. Without a "
    "val_loader the heads are not fitted (the family's own predictive); after another training "
    "loop, tune(bnn, val_loader, train_loader=...) fits them.")


#: ``bnn.runtime`` key: the family's member-wise Laplace heads are on by its default (not
#: asked for), so ``fit`` turns them off, with a warning, for a model whose classifier cannot
#: carry them (:func:`bayesify.kit.laplace_heads.settle`)
HEADS_BY_DEFAULT = "laplace_heads_by_default"


def laplace_heads_on() -> Any:
    """The ``laplace_heads`` field of a family that has the heads on by default: their
    spread grows off the data, which the families' own does not (benchmarks/RESULTS.md,
    "Member-wise Laplace heads"; issue 31)."""
    return option(True, LAPLACE_HEADS_HELP)


@dataclass(frozen=True)
class MethodConfig:
    """Fields shared by all methods: which layers receive a posterior."""

    targets: Any = option(
        "all",
        "Preset or explicit list of module names: 'all', 'last_layer', 'first:K', "
        "'last:K', or a list of qualified names / regex patterns.",
    )
    include: tuple[str, ...] = option(
        (), "Only wrap modules whose qualified name matches one of these (regex full "
        "match, exact name, or '.suffix')."
    )
    exclude: tuple[str, ...] = option(
        (), "Never wrap modules whose qualified name matches one of these patterns."
    )
    laplace_heads: bool = option(False, LAPLACE_HEADS_HELP)

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))
        check_field_types(self)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`BayesifyError` for out-of-range values (overridden per family)."""

    def default_samples(self) -> int:
        """n: samples per component of the default predictor (M = K·n members);
        ``predict_samples`` where the family has it, else 1 (deterministic members)."""
        return int(getattr(self, "predict_samples", 1))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def saved_defaults(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The options of a saved config (a manifest's), with what an option added since
        meant before it existed (overridden where a family added one that changes the
        posterior's tensors)."""
        return kwargs

    @classmethod
    def from_kwargs(cls, method: str, kwargs: dict[str, Any]) -> MethodConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise BayesifyError(
                f"unknown option(s) {unknown} for method {method!r}; "
                f"valid options are {sorted(known)}"
            )
        converted = {
            k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()
        }
        try:
            return cls(**converted)
        except (BayesifyError, TypeError) as err:
            message = str(err).removeprefix(f"{cls.__name__}: ")
            raise type(err)(f"method {method!r}: {message}") from err

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str]]:
        """``(name, default, help)`` for every field."""
        return [
            (f.name, f.default, f.metadata.get("help", ""))
            for f in dataclasses.fields(cls)
        ]


def require(condition: bool, message: str) -> None:
    """Raise :class:`BayesifyError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise BayesifyError(message)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_count(name: str) -> bool:
    return name == "components" or name.endswith("samples")


def _is_prior_scale(name: str) -> bool:
    return (name.startswith(("prior", "factor_prior")) and name.endswith(("_std", "precision"))
            or name.startswith("mixture_std"))


def check_field_types(config: MethodConfig) -> None:
    """Check every field of ``config`` against its annotation (see the module docstring).

    Raises ``TypeError`` for a value of the wrong kind and :class:`BayesifyError`
    for a non-finite or non-positive one; tuple fields given as lists become tuples.
    """
    cls = type(config)
    family = cls.__name__
    hints = _field_types(cls)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        hint = hints.get(f.name, Any)
        checked = _check_value(value, hint, f"{family}: {f.name}")
        if checked is not value:
            object.__setattr__(config, f.name, checked)
        if isinstance(checked, bool) or not isinstance(checked, Real):
            continue
        if _is_count(f.name) and checked <= 0:
            raise BayesifyError(f"{family}: {f.name} must be a positive integer, got {checked!r}")
        if _is_prior_scale(f.name) and checked <= 0:
            raise BayesifyError(f"{family}: {f.name} must be > 0, got {checked!r}")


def _check_value(value: Any, hint: Any, label: str) -> Any:
    """``value`` (tuples normalised) if it matches ``hint``; raises otherwise."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return value
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(value, option, label)
            except (TypeError, BayesifyError) as err:
                errors.append(err)
        raise errors[0] if errors else TypeError(f"{label} has an unsupported type")
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{label} must be a tuple, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            element_hints = [args[0]] * len(value)
        else:
            if len(value) != len(args):
                raise BayesifyError(f"{label} must have {len(args)} entries, got {value!r}")
            element_hints = list(args)
        items = [_check_value(v, h, f"{label}[{i}]")
                 for i, (v, h) in enumerate(zip(value, element_hints))]
        return tuple(items)
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{label} must be True or False, got {type(value).__name__} {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise TypeError(f"{label} must be an integer, got {type(value).__name__} {value!r}")
        return value if type(value) is int else int(value)  # numpy.int64 → int (JSON-safe)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{label} must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise BayesifyError(f"{label} must be a finite number, got {value!r}")
        if type(value) not in (int, float):  # numpy.float32 → float (JSON-safe)
            value = int(value) if isinstance(value, Integral) else float(value)
        return value
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"{label} must be a string, got {type(value).__name__} {value!r}")
        return value
    return value
