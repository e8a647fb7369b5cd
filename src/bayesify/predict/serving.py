"""What makes a predictor safe to serve: one lock per model, checked inputs and outputs.

**Threads.** A prediction changes state shared by everything that uses the same
network: the sampling plan every injected layer reads (``SamplingContext.plan``),
train/eval modes, caches some families keep. Each network therefore has one
re-entrant lock (:func:`model_lock` of :mod:`bayesify.core.locks`, kept outside the module so
models stay deep-copyable and picklable) and every predictor — and
``BayesianModel.predictive`` / ``member_logits`` themselves — hold it for the whole
prediction: any number of threads may call predictors of the same model and get
exactly the serial result; calls on one model run one at a time (use one model
copy per thread for parallel throughput). ``fit`` does not take the lock: do not
train a model while serving it.

**Inputs and outputs** (``nonfinite="error"``, the default): an input holding
NaN/inf is a :class:`BayesifyError` naming the rows; a finite input whose
predictive comes out non-finite (e.g. 1e30 pixels overflowing float32 in a
variance) is a :class:`BayesifyError` naming the largest input magnitude, never
silently NaN probabilities; an output whose rows are probability vectors (a
softmax model) is refused. ``nonfinite="propagate"`` skips these checks and lets
NaN flow through (for callers that mask such rows themselves).

**Temperatures** must be finite and > 0 (:func:`check_temperature`), whether set,
passed or read back from a saved posterior.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import torch

from bayesify.core.checks import check_finite_batch
from bayesify.core.locks import model_lock  # re-exported: the lock predictors take
from bayesify.core.outputs import check_not_probabilities
from bayesify.core.prediction import Prediction
from bayesify.errors import BayesifyError

__all__ = ["NONFINITE_POLICIES", "check_max_rows", "check_nonfinite_policy", "check_prediction",
           "check_temperature", "model_lock"]

NONFINITE_POLICIES = ("error", "propagate")


def check_temperature(value: Any, *, where: str = "temperature") -> float:
    """``value`` as a float if it is a finite number > 0; raises otherwise."""
    if isinstance(value, bool) or not isinstance(value, (Real, torch.Tensor)):
        raise TypeError(f"{where} must be a finite number > 0, got {type(value).__name__} "
                        f"{value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{where} must be one number, got a tensor of shape "
                            f"{tuple(value.shape)}")
        value = value.item()
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise BayesifyError(
            f"{where} must be a finite number > 0, got {value!r}: the predictive is "
            "softmax(log p / T), so 0 or a negative value flips or destroys every prediction (1 = uncalibrated)")
    return value


def check_max_rows(value: Any) -> int:
    """``max_rows`` (rows per forward pass) as an int if it is an integer ≥ 1."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"max_rows must be a positive integer (rows per forward pass, default "
                        f"4096), got {type(value).__name__} {value!r}")
    if value < 1:
        raise BayesifyError(
            f"max_rows must be a positive integer, got {value!r}: it is the number of rows "
            "(members × inputs) one forward pass may hold; the default 4096 suits most "
            "models, lower it to save memory")
    return int(value)


def check_nonfinite_policy(value: Any) -> str:
    if value not in NONFINITE_POLICIES:
        raise BayesifyError(f"nonfinite must be one of {list(NONFINITE_POLICIES)}, got {value!r}")
    return value


def check_inputs(inputs: Any, policy: str, *, where: str = "predictor") -> None:
    """Refuse NaN/inf inputs (``policy == "error"``)."""
    if policy == "error":
        check_finite_batch(inputs, where=where)


def _largest_input(inputs: Any) -> float:
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else [
        *getattr(inputs, "args", ()), *getattr(inputs, "kwargs", {}).values()]
    values = [float(t.detach().abs().max()) for t in tensors
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    return max(values, default=0.0)


def _broken_rows(tensor: torch.Tensor) -> int:
    """Rows ``[..., C]`` holding NaN or +inf, or only -inf (a masked class is fine)."""
    rows = tensor.detach().reshape(-1, tensor.shape[-1])
    bad = torch.isnan(rows).any(-1) | torch.isposinf(rows).any(-1) | torch.isneginf(rows).all(-1)
    return int(bad.sum())


def check_prediction(prediction: Prediction, inputs: Any, policy: str, *, family: str,
                     where: str = "predictor") -> None:
    """Refuse a non-finite predictive of finite inputs and probability-like outputs."""
    if policy != "error":
        return
    if prediction.is_gaussian:
        broken = _broken_rows(prediction.mean) + int(
            (~torch.isfinite(prediction.variance)).reshape(-1, prediction.variance.shape[-1])
            .any(-1).sum())
    else:
        broken = _broken_rows(prediction.member_logits)
    if broken:
        largest = _largest_input(inputs)
        cause = (f"inputs this large (largest |input| {largest:.3g}) overflow the network's "
                 "floating-point range in this posterior (e.g. a variance of x²); normalise "
                 "the inputs as the network was trained" if largest > 1e6 else
                 f"the network or posterior itself produces them (largest |input| only "
                 f"{largest:.3g}): check the model and the fit for divergence")
        raise BayesifyError(
            f"{where}: the model produced non-finite logits for {broken} row(s) of finite "
            f"inputs (the {family} predictive is NaN/inf): {cause}; nonfinite='propagate' "
            "lets NaN through")
    check_not_probabilities(prediction.mean if prediction.is_gaussian
                            else prediction.member_logits, where=where)
