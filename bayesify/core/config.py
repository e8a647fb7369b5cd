"""Configuration base shared by every posterior family.

Each family defines a frozen dataclass deriving from :class:`MethodConfig`; every
field carries a ``help`` text (``field(metadata={"help": ...})``) that the CLI and
``describe_config`` show.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bayesify.errors import BayesifyError


def option(default: Any, help: str) -> Any:
    """A dataclass field with a help text (tuples/lists become immutable defaults)."""
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={"help": help})


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

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`BayesifyError` for out-of-range values (overridden per family)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

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
        return cls(**converted)

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
