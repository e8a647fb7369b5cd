"""``fit(epochs=None)``'s step budget: whole epochs until a number of optimiser steps.

Every entry point (``bayesify.fit``, ``bayesify fit``, ``bayesify demo``, the ImageNet
example) leaves ``epochs`` to this budget unless given, and says so with
:data:`EPOCHS_HELP`.
"""

from __future__ import annotations

import logging
import math
import os

from bayesify.errors import BayesifyError

logger = logging.getLogger(__name__)

#: the step budget of ``fit(epochs=None)``: whole epochs until this many optimiser steps
#: (the environment variable ``BAYESIFY_MIN_STEPS`` overrides it, e.g. for quick tests)
DEFAULT_MIN_STEPS = 300


def default_min_steps() -> int:
    """:data:`DEFAULT_MIN_STEPS`, or ``$BAYESIFY_MIN_STEPS`` when set (a positive integer)."""
    value = os.environ.get("BAYESIFY_MIN_STEPS")
    if value is None:
        return DEFAULT_MIN_STEPS
    if not value.isdigit() or int(value) < 1:
        raise BayesifyError(f"BAYESIFY_MIN_STEPS must be a positive integer, got {value!r}")
    return int(value)


#: the ``--epochs`` help of every entry point (CLI fit and demo, the ImageNet example):
#: they all leave ``epochs`` to :func:`fit`'s step budget unless given
EPOCHS_HELP = (f"posterior fine-tuning epochs (default: enough epochs for at least "
               f"{DEFAULT_MIN_STEPS} optimiser steps, bayesify.fit's budget; Laplace makes "
               "one pass)")


def budget_epochs(batches_per_epoch: int, grad_accum_steps: int, min_steps: int) -> int:
    """Whole epochs that reach ``min_steps`` optimiser steps (1 for a loader without a length)."""
    if batches_per_epoch <= 0:
        logger.info("the training loader has no length: fit(epochs=None) trains one epoch")
        return 1
    per_epoch = max(1, math.ceil(batches_per_epoch / max(grad_accum_steps, 1)))
    return max(1, math.ceil(min_steps / per_epoch))
