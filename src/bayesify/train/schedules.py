"""KL-weight and learning-rate schedules as pure functions of training progress.

``progress`` is measured in (fractional) epochs so that schedules are exact under
resume and independent of the number of steps per epoch: the trainer evaluates
them at ``epoch + batch / batches_per_epoch`` before every step and keeps no
scheduler state (a checkpoint only needs the epoch and the step).

Recipes of the iBNN paper in this vocabulary:

- CIFAR, 300 epochs: ``beta_schedule(p, anneal_epochs=200)`` (β 0 → 1 over the
  first 200 epochs), weights ``("linear", 150, 270, 0.01)``, posterior constant;
- pretrained ResNet-50 on ImageNet, 15 epochs: β fixed at 1
  (``anneal_epochs=0``), weights constant at 1e-4, posterior 0.2 → 0.05 over four
  epochs starting from epoch 6: ``("linear", 6, 10, 0.25)``.
"""

from __future__ import annotations

import math
from typing import Any

from bayesify.errors import BayesifyError

SCHEDULE_HELP = (
    "'constant'; 'cosine' (to 0 at the last epoch); 'cosine:WARMUP' (linear warm-up over "
    "WARMUP epochs, then cosine); 'linear:A:B:END' (factor 1 until epoch A, linearly to END "
    "at epoch B, then END)"
)


def beta_schedule(progress: float, *, anneal_epochs: float, beta_max: float = 1.0) -> float:
    """KL weight β(t): linear 0 → ``beta_max`` over ``anneal_epochs`` (fixed if 0)."""
    if anneal_epochs <= 0:
        return beta_max
    return beta_max * min(1.0, progress / anneal_epochs)


def parse_schedule(spec: Any) -> Any:
    """Normalise a schedule: strings like ``"linear:6:10:0.25"`` become tuples.

    Accepted: ``"constant"`` / ``None``; ``"cosine"``; ``"cosine:W"`` or
    ``("cosine", W)`` (W warm-up epochs); ``"linear:A:B:END"`` or
    ``("linear", A, B, END)``. Raises :class:`BayesifyError` otherwise.
    """
    if spec is None or spec == "constant":
        return "constant"
    if spec == "cosine":
        return "cosine"
    if isinstance(spec, str):
        name, *args = spec.split(":")
        try:
            values = tuple(float(a) for a in args)
        except ValueError:
            raise BayesifyError(f"cannot parse LR schedule {spec!r}; use {SCHEDULE_HELP}") from None
        spec = (name, *values)
    if isinstance(spec, (tuple, list)):
        spec = tuple(spec)
        if len(spec) == 4 and spec[0] == "linear":
            _, start, stop, end = spec
            if not (0 <= float(start) < float(stop)) or float(end) < 0:
                raise BayesifyError(
                    f"linear schedule {spec!r} needs 0 <= start < stop and end >= 0"
                )
            return ("linear", float(start), float(stop), float(end))
        if len(spec) == 2 and spec[0] == "cosine" and float(spec[1]) >= 0:
            return ("cosine", float(spec[1]))
        if len(spec) == 1 and spec[0] in ("constant", "cosine"):
            return spec[0]
    raise BayesifyError(f"unknown LR schedule {spec!r}; use {SCHEDULE_HELP}")


def lr_factor(progress: float, schedule: Any, *, epochs: float) -> float:
    """Multiplier of the base learning rate at ``progress`` epochs.

    ``schedule``: ``"constant"``; ``"cosine"`` (to 0 at ``epochs``);
    ``("cosine", w)``: linear warm-up 0 → 1 over ``w`` epochs, then cosine to 0
    at ``epochs``; ``("linear", a, b, end)``: constant 1 until epoch a, linearly
    to ``end`` at epoch b, then constant (the iBNN ImageNet recipe: 0.2 → 0.05
    over epochs 6–10 is ``("linear", 6, 10, 0.25)``). Strings such as
    ``"linear:6:10:0.25"`` are accepted too.
    """
    if schedule in (None, "constant"):
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress / max(epochs, 1e-12))))
    if isinstance(schedule, str):
        schedule = parse_schedule(schedule)
        return lr_factor(progress, schedule, epochs=epochs)
    if isinstance(schedule, (tuple, list)) and len(schedule) == 4 and schedule[0] == "linear":
        _, start, stop, end = schedule
        if progress <= start:
            return 1.0
        if progress >= stop:
            return float(end)
        return 1.0 + (float(end) - 1.0) * (progress - start) / (stop - start)
    if isinstance(schedule, (tuple, list)) and len(schedule) == 2 and schedule[0] == "cosine":
        warmup = float(schedule[1])
        if warmup > 0 and progress < warmup:
            return progress / warmup
        span = max(epochs - warmup, 1e-12)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup) / span)))
    raise BayesifyError(f"unknown LR schedule {schedule!r}; use {SCHEDULE_HELP}")
