"""Validation of every ``bayesify.fit`` keyword before anything changes.

``fit`` calls :func:`validate_fit_options` first, so a bad value is refused with
a message naming the option, what it got and what is allowed, before the model
is moved, an optimiser is built or a step is taken. Types: a ``bool`` is never
accepted for a number (``True`` is an ``int`` in Python), and a string is never
accepted for a number (``lr="0.1"``). Numbers must be finite.

Names ``fit`` passes that are not options (the model, loaders, callbacks, extra
keywords for post-hoc families) are ignored here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from numbers import Integral, Real
from typing import Any

import torch

from bayesify.errors import BayesifyError

__all__ = ["FIT_OPTION_RULES", "validate_fit_options"]


def _type_name(value: Any) -> str:
    return type(value).__name__


def _number(name: str, value: Any, *, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"fit option {name} must be {what}, got {_type_name(value)} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise BayesifyError(f"fit option {name} must be {what}, got {value!r}")
    return value


def _integer(name: str, value: Any, *, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        hint = " (a whole number: 1.5 epochs is not a count)" if isinstance(value, float) else ""
        raise TypeError(f"fit option {name} must be {what}, got {_type_name(value)} {value!r}{hint}")
    return int(value)


def positive(name: str, value: Any) -> None:
    """A finite number > 0."""
    if _number(name, value, what="a finite number > 0") <= 0:
        raise BayesifyError(f"fit option {name} must be a finite number > 0, got {value!r}")


def non_negative(name: str, value: Any) -> None:
    """A finite number >= 0."""
    if _number(name, value, what="a finite number >= 0") < 0:
        raise BayesifyError(f"fit option {name} must be a finite number >= 0, got {value!r}")


def fraction(name: str, value: Any) -> None:
    """A finite number in [0, 1)."""
    v = _number(name, value, what="a finite number in [0, 1)")
    if not 0 <= v < 1:
        raise BayesifyError(f"fit option {name} must lie in [0, 1), got {value!r}")


def count(minimum: int) -> Callable[[str, Any], None]:
    """An integer >= ``minimum`` (not a bool, not a float)."""

    what = "positive (an integer >= 1)" if minimum == 1 else f"an integer >= {minimum}"

    def check(name: str, value: Any) -> None:
        if _integer(name, value, what=what) < minimum:
            raise BayesifyError(f"fit option {name} must be {what}, got {value!r}")

    return check


def optional(rule: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is not None:
            rule(name, value)

    return check


def flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"fit option {name} must be True or False, got {_type_name(value)} {value!r}")


def choice(*allowed: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not isinstance(value, str) or value not in allowed:
            raise BayesifyError(f"fit option {name} must be one of {list(allowed)}, got {value!r}")

    return check


def schedule(name: str, value: Any) -> None:
    """Anything :func:`bayesify.train.schedules.parse_schedule` accepts, with finite numbers."""
    from bayesify.train.schedules import parse_schedule

    try:
        parsed = parse_schedule(value)
    except (BayesifyError, TypeError, ValueError) as err:
        raise BayesifyError(f"fit option {name}: {err}") from err
    numbers = parsed[1:] if isinstance(parsed, tuple) else ()
    if not all(isinstance(v, float) and math.isfinite(v) for v in numbers):
        raise BayesifyError(f"fit option {name} must hold finite numbers, got {value!r}")


def path_like(name: str, value: Any) -> None:
    if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        raise TypeError(f"fit option {name} must be a path (str or os.PathLike), got "
                        f"{_type_name(value)} {value!r}")


def device_like(name: str, value: Any) -> None:
    if isinstance(value, torch.device) or (isinstance(value, Integral)
                                           and not isinstance(value, bool) and value >= 0):
        return
    if not isinstance(value, str):
        raise TypeError(f"fit option {name} must be a device string or torch.device, got "
                        f"{_type_name(value)} {value!r}")
    try:
        torch.device(value)
    except RuntimeError as err:
        raise BayesifyError(f"fit option {name}: {value!r} is not a device ({err})") from err


def seed_value(name: str, value: Any) -> None:
    if _integer(name, value, what="an integer in [0, 2**63)") < 0 or value >= 2**63:
        raise BayesifyError(f"fit option {name} must be an integer in [0, 2**63), got {value!r}")


def compile_option(name: str, value: Any) -> None:
    if not isinstance(value, (bool, Mapping)):
        raise TypeError(f"fit option {name} must be True/False or a dict of torch.compile "
                        f"options, got {_type_name(value)} {value!r}")


def callback_list(name: str, value: Any) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"fit option {name} must be a list of callbacks, got {_type_name(value)}")


def reiterable(name: str, value: Any) -> None:
    """A loader ``fit`` can read more than once: not an iterator that is its own iterator (a
    generator, ``iter(list)``) — ``fit`` reads a first batch to check the model, then every
    epoch; the validation search streams the split once per candidate. Before this rule a
    generator failed with "the training loader produced no batches" after its first batch
    had been read."""
    if not isinstance(value, Iterable):  # (iter() itself would start a loader's workers)
        raise TypeError(f"fit's {name} must be an iterable of batches (a DataLoader, a list), "
                        f"got {_type_name(value)}")
    if isinstance(value, Iterator):
        raise BayesifyError(
            f"fit's {name} is a one-shot iterator ({_type_name(value)}: iter(x) is x), but fit "
            "reads it more than once (a first batch to check the model, then every epoch; the "
            "validation search once per candidate); pass a torch DataLoader, or a list of "
            "batches (list(...))")


#: option name → rule; every rule raises TypeError/BayesifyError naming the option
FIT_OPTION_RULES: dict[str, Callable[[str, Any], None]] = {
    "epochs": optional(count(1)),
    "min_steps": optional(count(1)),
    "lr": optional(positive),
    "base_lr": non_negative,
    "kl_anneal_epochs": non_negative,
    "beta": non_negative,
    "lr_schedule": optional(schedule),
    "base_lr_schedule": schedule,
    "optimizer": optional(choice("sgd", "adam", "adamw")),
    "momentum": optional(fraction),
    "weight_decay": optional(non_negative),
    "base_weight_decay": non_negative,
    "n_train": optional(count(1)),
    "device": optional(device_like),
    "log_dir": optional(path_like),
    "progress": flag,
    "seed": optional(seed_value),
    "amp": optional(flag),
    "channels_last": flag,
    "compile": compile_option,
    "grad_accum_steps": count(1),
    "clip_grad_norm": optional(positive),
    "checkpoint_dir": optional(path_like),
    "checkpoint_every_steps": count(0),
    "keep_checkpoints": count(0),
    "resume": optional(path_like),
    "callbacks": callback_list,
    "val_every": optional(count(1)),
    "val_samples_per_component": optional(count(1)),
    "train_loader": reiterable,
    "val_loader": optional(reiterable),
    "shift_loader": optional(reiterable),  # any labelled loader (batches checked when read)
    "find_unused_parameters": flag,
    "timeout_s": optional(positive),
    "timeout": optional(positive),
}


def validate_fit_options(**options: Any) -> None:
    """Raise ``TypeError`` / :class:`BayesifyError` for the first bad ``fit`` option.

    Call with every keyword ``fit`` received (``validate_fit_options(**locals())``
    at the top of ``fit`` works: names that are not options are ignored). Checks:
    counts (``epochs``, ``n_train``, ``grad_accum_steps``, ``val_every``, …) are
    integers, not bools or floats, within range; rates and weights (``lr``,
    ``base_lr``, ``beta``, ``momentum``, ``weight_decay``, ``clip_grad_norm``,
    ``timeout_s``) are finite numbers in range; choices, flags, paths and
    schedules have the right form.
    """
    for name, rule in FIT_OPTION_RULES.items():
        if name in options:
            rule(name, options[name])
