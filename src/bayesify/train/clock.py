"""How long a fit will take, said early, and validation that costs what it is worth.

:class:`FitClock` is one of the epoch driver's callbacks. After the first optimiser steps
(:meth:`FitClock.log_step`: 5 % of the fit, between the 2nd and the 10th step — always
before a tenth is done when the fit has 20 steps or more) it logs the expected total::

    fit: about 5.1 min in all — 140 optimiser steps × 1.9 s = 4.4 min of training (measured
    on steps 2–7) + ≈ 0.7 min of validation (...)

and puts ``expected_seconds`` into the first epoch's record. The validation part is the
starting network's validation time (measured) × the predictor's members per example, once
per planned validation, plus the validation search (``grid × 2`` passes: clean and one
interleaved shifted copy).

**Validation between epochs** (``fit(val_every=None)``, the default) runs only while it is
cheap: validation may take :attr:`FitClock.VALIDATION_SHARE` (25 %) of the training work, and
an epoch is validated when that allowance, accumulated over the epochs so far, passes one
more validation. The work is counted, not timed, whenever both sets have a length:
a training epoch is ``N_train × rows per example × 3`` forward passes (forward and backward),
a validation ``N_val × members``. So which epochs are validated — and so which states
keep-best can fall back to — is the same on every machine, under any load, for every world
size and after a resume (it was decided on measured seconds, and the same seed ended at
different posteriors on a loaded and an idle machine). Without lengths it falls back to the
measured seconds. The last epoch is always validated (the knob search and the comparison
with the start need it); ``val_every=N`` validates every N-th epoch whatever it costs.
Under ``torchrun`` rank 0 decides and every rank follows (the validation is a collective).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from bayesify.train.distributed import broadcast_object

logger = logging.getLogger(__name__)


def _minutes(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class FitClock:
    """The fit's expected duration and the validation schedule (see the module docstring)."""

    #: share of the training work that validation between epochs may take
    VALIDATION_SHARE = 0.25
    #: forward passes one training row costs (its forward and its backward)
    TRAIN_ROW_FORWARDS = 3

    def __init__(self, state: Any, *, start_seconds: float | None, val_every: int | None,
                 samples_per_component: int | None = None) -> None:
        self.state, self.val_every = state, val_every
        self.first_step = state.global_step
        self.marks: list[float] = []
        self._began = time.perf_counter()
        self.logged = False
        self.train_seconds = self.val_seconds = 0.0
        bnn = state.bnn
        members = bnn.method.components * (samples_per_component
                                            or bnn.posterior_config.default_samples())
        #: one validation of the posterior, estimated from the starting network's
        self.val_estimate = (start_seconds * members if start_seconds is not None
                             and state.val_loader is not None else None)
        knobs = bnn.method.knobs(bnn) if state.val_loader is not None else []
        self.search_passes = 2 * max(1, sum(len(k.grid) for k in knobs))
        #: validations per training epoch that the share allows, by counted work (None:
        #: a set without a length, the schedule falls back to measured seconds)
        self.per_epoch_allowance = self._allowance(members)

    def _allowance(self, members: int) -> float | None:
        from bayesify.train.budget import rows_per_example  # same floor (train)

        state = self.state
        n_train, n_val = _length(getattr(state, "train_loader", None)), _length(state.val_loader)
        if not n_train or not n_val:
            return None
        epoch = n_train * rows_per_example(state.family) * self.TRAIN_ROW_FORWARDS
        return self.VALIDATION_SHARE * epoch / (n_val * max(members, 1))

    def counted_validation(self, epoch: int) -> bool:
        """By counted work: whether the allowance accumulated over epochs ``0..epoch`` passes
        a whole validation more than that of epochs ``0..epoch-1`` (stateless: the same
        answer after a resume)."""
        a = self.per_epoch_allowance
        assert a is not None
        return math.floor(a * (epoch + 1) + 1e-9) > math.floor(a * epoch + 1e-9)

    # -- the expected duration ------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        s = self.state
        per_epoch = math.ceil(max(s.steps_per_epoch, 0) / max(s.grad_accum_steps, 1))
        return max(1, per_epoch * int(s.epochs))

    def log_step(self) -> int:
        """The optimiser step after which the estimate is logged."""
        return max(2, min(10, math.ceil(0.05 * self.total_steps)))

    def on_step_end(self, state: Any, terms: dict[str, float]) -> None:
        if self.logged:
            return
        self.marks.append(time.perf_counter())
        done = state.global_step - self.first_step
        if done >= self.log_step() or done >= self.total_steps:
            self.logged = True
            self._log(done)

    def _log(self, done: int) -> None:
        marks = self.marks
        # the first step carries warm-up (allocations, the first batch's checks): measured
        # from the end of the first step on, unless there is only one
        if len(marks) >= 2:
            per_step = (marks[-1] - marks[0]) / (len(marks) - 1)
            measured = f"steps 2–{done}" if done > 2 else "step 2"
        else:
            per_step, measured = marks[-1] - self._began, "the first step"
        training = per_step * self.total_steps
        validation, what = self._validation_estimate(training)
        total = self._same_on_every_rank(training + validation)
        self.state.logged["expected_seconds"] = total
        if self.state.ctx.is_main:
            logger.info("fit: about %s in all — %d optimiser steps × %.2g s = %s of training "
                        "(measured on %s)%s", _minutes(total), self.total_steps, per_step,
                        _minutes(training), measured,
                        f" + ≈ {_minutes(validation)} of validation ({what})" if what else "")

    def _validation_estimate(self, training: float) -> tuple[float, str]:
        if self.val_estimate is None:
            return 0.0, ""
        epochs, per = int(self.state.epochs), self.val_estimate
        if self.val_every is not None:
            count = sum(1 for e in range(epochs) if (e + 1) % self.val_every == 0
                        or e + 1 == epochs)
            rule = f"every {self.val_every} epoch(s)"
        elif self.per_epoch_allowance is not None:  # the last, and earlier ones by the share
            between = sum(self.counted_validation(e) for e in range(epochs - 1))
            count, rule = 1 + between, "between epochs while under 25 % of the training work"
        else:  # the last, and earlier ones while under the share of the training time
            between = min(epochs - 1, int(self.VALIDATION_SHARE * training / max(per, 1e-9)))
            count, rule = 1 + between, "between epochs only while under 25 % of the training time"
        search = per * self.search_passes
        what = (f"{count} validation(s) ≈ {_minutes(per)} each, {rule}; the validation "
                f"search ≈ {self.search_passes} passes")
        return per * count + search, what

    # -- the validation schedule ----------------------------------------------------------
    def should_validate(self, record: dict[str, Any], *, epoch: int, is_last: bool) -> bool:
        """Whether to validate after ``epoch`` (0-based) whose record is ``record``."""
        self.train_seconds += float(record.get("seconds", 0.0))
        if is_last:
            return True
        if self.val_every is not None:
            return (epoch + 1) % max(self.val_every, 1) == 0
        if self.per_epoch_allowance is not None:
            return self.counted_validation(epoch)  # the same on every rank: no broadcast
        estimate = self.val_estimate if self.val_estimate is not None else 0.0
        cheap = self.val_seconds + estimate <= self.VALIDATION_SHARE * self.train_seconds
        ctx = self.state.ctx
        return bool(broadcast_object(cheap, ctx)) if ctx.distributed else cheap

    def validated(self, seconds: float) -> float:
        """A validation took ``seconds``: the next estimate is that; returns ``seconds``
        (rank 0's under ``torchrun``: the history is the same on every rank)."""
        seconds = self._same_on_every_rank(seconds)
        self.val_seconds += seconds
        self.val_estimate = seconds
        return seconds

    def _same_on_every_rank(self, value: float) -> float:
        ctx = self.state.ctx
        return float(broadcast_object(value, ctx)) if ctx.distributed else value

    def on_epoch_end(self, state: Any, record: dict[str, Any]) -> None:
        return None


def _length(loader: Any) -> int | None:
    """Examples in a loader's dataset, or None when it has no length."""
    dataset = getattr(loader, "dataset", None)  # lists of batches, custom iterables: none
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:  # an IterableDataset
        return None
