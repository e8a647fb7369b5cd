"""KL-weight and learning-rate schedules as pure functions of training progress.

``progress`` is measured in (fractional) epochs so that schedules are exact under
resume and independent of the number of steps per epoch.
"""

from __future__ import annotations

import math
from typing import Any

from bayesify.errors import BayesifyError


def beta_schedule(progress: float, *, anneal_epochs: float, beta_max: float = 1.0) -> float:
    """KL weight β(t): linear 0 → ``beta_max`` over ``anneal_epochs`` (fixed if 0)."""
    if anneal_epochs <= 0:
        return beta_max
    return beta_max * min(1.0, progress / anneal_epochs)


def lr_factor(progress: float, schedule: Any, *, epochs: float) -> float:
    """Multiplier of the base learning rate at ``progress`` epochs.

    ``schedule``: ``"constant"``; ``"cosine"`` (to 0 at ``epochs``);
    ``("linear", a, b, end)``: constant 1 until epoch a, linearly to ``end`` at
    epoch b, then constant (the iBNN ImageNet recipe: 0.2 → 0.05 over epochs 6–10
    is ``("linear", 6, 10, 0.25)``).
    """
    if schedule in (None, "constant"):
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress / max(epochs, 1e-12))))
    if isinstance(schedule, (tuple, list)) and len(schedule) == 4 and schedule[0] == "linear":
        _, start, stop, end = schedule
        if progress <= start:
            return 1.0
        if progress >= stop:
            return float(end)
        return 1.0 + (float(end) - 1.0) * (progress - start) / (stop - start)
    raise BayesifyError(
        f"unknown LR schedule {schedule!r}; use 'constant', 'cosine' or "
        "('linear', start_epoch, stop_epoch, end_factor)"
    )
