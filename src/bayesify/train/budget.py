"""``fit(epochs=None)``'s budget: whole epochs until a number of forward passes.

A training step of a family that tiles every example R times (iBNN: S repeats, a deep
ensemble: K members) costs R forward and backward passes per example, so a budget in
optimiser steps costs R times more on one family than another, and more with a larger
batch. The default budget counts **forward passes of one example** instead:
:data:`DEFAULT_FORWARDS` (8,192), i.e. whole epochs until ``epochs · N_train · R`` reaches
it — 14 epochs of 300 images for iBNN (R = 2), one epoch of anything larger than 8,192
examples. ``min_steps=`` (or ``$BAYESIFY_MIN_STEPS``) asks for the older budget in optimiser
steps instead; ``epochs=N`` trains exactly N.

Every entry point (``bayesify.fit``, ``bayesify fit``, ``bayesify demo``, the ImageNet
example) leaves ``epochs`` to this budget unless given, and says so with
:data:`EPOCHS_HELP`.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

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


#: the budget of ``fit(epochs=None)``: whole epochs until this many forward passes of one
#: training example (an example tiled to R rows costs R); on a 2-core CPU an
#: EfficientNet-Lite0 at 64 px trains ~30–50 such passes a second (benchmarks/RESULTS.md)
DEFAULT_FORWARDS = 8192

#: the ``--epochs`` help of every entry point (CLI fit and demo, the ImageNet example):
#: they all leave ``epochs`` to :func:`fit`'s budget unless given
EPOCHS_HELP = (f"posterior fine-tuning epochs (default: enough epochs for at least "
               f"{DEFAULT_FORWARDS} forward passes of one training example, bayesify.fit's "
               "budget, at least one epoch; Laplace makes one pass)")


def rows_per_example(step: Any) -> int:
    """R: rows one training example becomes in the family's step (its batch layout's
    rows for a batch of one; 1 for a step without a layout)."""
    layout = getattr(step, "layout", None)
    if layout is None or not hasattr(layout, "components"):
        return 1
    try:
        return max(1, int(layout.components(1, torch.device("cpu")).numel()))
    except Exception:  # noqa: BLE001 - a layout that needs more than a size: count one row
        return 1


def default_epochs(*, batches_per_epoch: int, grad_accum_steps: int, n_train: int, step: Any,
                   min_steps: int | None) -> tuple[int, str]:
    """``fit(epochs=None)``'s epochs and the sentence that logs them: the forward-pass
    budget (:data:`DEFAULT_FORWARDS`), or whole epochs until ``min_steps`` optimiser steps
    when ``min_steps`` (or ``$BAYESIFY_MIN_STEPS``) is given."""
    if min_steps is not None or os.environ.get("BAYESIFY_MIN_STEPS") is not None:
        budget = default_min_steps() if min_steps is None else min_steps
        epochs = budget_epochs(batches_per_epoch, grad_accum_steps, budget)
        return epochs, (f"fit(epochs=None): {epochs} epoch(s) of {batches_per_epoch} batch(es) "
                        f"for a budget of {budget} optimiser steps (min_steps / "
                        "$BAYESIFY_MIN_STEPS)")
    rows = rows_per_example(step)
    if n_train <= 0:  # the budget counts examples: a loader without a length needs none
        return 1, "fit(epochs=None): the number of training examples is unknown: one epoch"
    epochs = max(1, math.ceil(DEFAULT_FORWARDS / (n_train * rows)))
    return epochs, (f"fit(epochs=None): {epochs} epoch(s) of {n_train} examples × {rows} "
                    f"row(s) each = {epochs * n_train * rows} forward passes, for a budget of "
                    f"{DEFAULT_FORWARDS} (epochs=N fixes it; min_steps= counts optimiser steps)")


#: the smallest optimiser batch (examples per step, over ranks and accumulation) the
#: families' default learning rates assume; a smaller one scales them down (linear rule)
REFERENCE_BATCH = 16


def small_batch_factor(*, examples_per_step: float | None, optimizer: str) -> float:
    """The multiplier of a *default* learning rate for ``examples_per_step`` < 16.

    The loss of a step is the mean over its batch, so an epoch of batch-B SGD moves the
    posterior by about ``lr · N/B`` mean gradients: at a fixed epoch budget (the forward-pass
    budget above) a batch of one drifts 16× as far as a batch of 16 at the same rate. The
    linear scaling rule (Goyal et al. 2017; the square root for Adam, Malladi et al. 2022)
    keeps the trajectory of the batch the defaults were chosen at. Measured on the stress
    matrix's ``batch_of_one`` (64 images, batches of one, benchmarks/results/session5.md):
    mean-field without validation lost 8–9 points of accuracy at the unscaled rate, with the
    learned spread switched off too (the means had moved), and none at a tenth of it.
    1 for batches of at least 16 or an unknown batch size.
    """
    if examples_per_step is None or not examples_per_step > 0:
        return 1.0
    ratio = min(1.0, float(examples_per_step) / REFERENCE_BATCH)
    return ratio if optimizer == "sgd" else math.sqrt(ratio)


def budget_epochs(batches_per_epoch: int, grad_accum_steps: int, min_steps: int) -> int:
    """Whole epochs that reach ``min_steps`` optimiser steps (1 for a loader without a length)."""
    if batches_per_epoch <= 0:
        logger.info("the training loader has no length: fit(epochs=None) trains one epoch")
        return 1
    per_epoch = max(1, math.ceil(batches_per_epoch / max(grad_accum_steps, 1)))
    return max(1, math.ceil(min_steps / per_epoch))
