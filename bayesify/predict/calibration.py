"""Temperature scaling of an ensemble predictor (Guo et al. 2017, for mixtures).

One temperature T divides every member's logits; it minimises the validation
NLL of the *mixture*

    NLL(T) = −(1/N) Σ_n log( (1/M) Σ_m softmax(f_m(x_n) / T)[y_n] ),

optimised by LBFGS over log T (so T stays positive), started from the best of
a coarse grid and kept in ``T_BOUNDS``. The fit never makes the validation NLL
worse: when the optimum is not better than the predictor's current temperature,
that one is kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bayesify import metrics
from bayesify.core.checks import check_finite_logits, check_labels
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.predict.predictor import BasePredictor

METHODS = ("temperature",)
#: coarse grid of log T the LBFGS run starts from (T in [1/20, 20])
_LOG_T_GRID = torch.linspace(-math.log(20.0), math.log(20.0), 13)
#: T is kept in this range: on a small validation set the mixture NLL can keep falling
#: as T → 0 (the members' hard votes become the probabilities), which overfits
T_BOUNDS = (1e-2, 1e2)


@dataclass(frozen=True)
class CalibrationResult:
    """What :func:`calibrate` found on the validation set (NLL/ECE before and after)."""

    method: str
    temperature: float
    previous_temperature: float
    optimum_temperature: float
    kept_previous: bool
    nll_before: float
    nll_after: float
    ece_before: float
    ece_after: float
    n: int
    plot: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _collect(predictor: BasePredictor, loader: Iterable) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``predictor.collect`` with an empty loader turned into a clear error."""
    try:
        if len(loader) == 0:  # type: ignore[arg-type]
            raise BayesifyError("calibrate: the validation loader is empty (len 0); pass a "
                                "loader with at least one labelled batch")
    except TypeError:  # an unsized iterable: found out below
        pass
    try:
        return predictor.collect(loader)
    except (RuntimeError, ValueError) as err:  # torch.cat([]) on an empty loader
        if "non-empty" in str(err):
            raise BayesifyError("calibrate: the validation loader produced no batches; pass a "
                                "loader with at least one labelled batch") from err
        raise


def mixture_nll(member_logits: torch.Tensor, labels: torch.Tensor, log_t: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the mixture at temperature ``exp(log_t)``; ``[M, N, C]``, ``[N]`` → scalar.

    ``log softmax(f/T)[y] = f_y/T − logsumexp_c(f_c/T)``; the mixture adds
    ``logsumexp_m(·) − log M``. Differentiable in ``log_t``.
    """
    scaled = member_logits / log_t.exp()
    index = labels.view(1, -1, 1).expand(scaled.shape[0], -1, 1)
    member_log_py = scaled.gather(-1, index).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    log_py = torch.logsumexp(member_log_py, dim=0) - math.log(scaled.shape[0])
    return -log_py.mean()


def fit_temperature(member_logits: torch.Tensor, labels: torch.Tensor, *,
                    max_iter: int = 100) -> float:
    """argmin_T of :func:`mixture_nll` (LBFGS on log T from the best grid point).

    ``member_logits [M, N, C]`` must be finite and ``labels [N]`` class indices
    in ``[0, C)`` with ``N > 0`` (:class:`BayesifyError` otherwise).
    """
    if member_logits.dim() != 3 or member_logits.shape[1] == 0:
        raise BayesifyError(f"fit_temperature needs member logits [M, N, C] with N > 0, got "
                            f"shape {tuple(member_logits.shape)}")
    check_finite_logits(member_logits, where="fit_temperature")
    labels = check_labels(labels.detach(), member_logits.shape[-1], where="fit_temperature")
    logits = member_logits.detach().float()
    labels = labels.to(logits.device)
    with torch.no_grad():
        grid = torch.stack([mixture_nll(logits, labels, t) for t in _LOG_T_GRID])
    start = _LOG_T_GRID[int(torch.nan_to_num(grid, nan=math.inf).argmin())]
    log_t = start.clone().to(logits.device).requires_grad_(True)
    optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter,
                                  line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = mixture_nll(logits, labels, log_t)
        loss.backward()
        return loss

    optimizer.step(closure)
    value = float(log_t.detach().exp())
    if not math.isfinite(value):
        return float(start.exp())
    value = min(max(value, T_BOUNDS[0]), T_BOUNDS[1])
    with torch.no_grad():
        clamped = mixture_nll(logits, labels, torch.tensor(math.log(value)))
        at_start = mixture_nll(logits, labels, start)
    return value if clamped <= at_start else float(start.exp())


def calibration_stats(member_logits: torch.Tensor, labels: torch.Tensor,
                      temperature: float, n_bins: int = 15) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """``(nll, ece, confidence [N], correct [N])`` of the mixture at ``temperature``."""
    log_probs = metrics.mixture_log_probs(member_logits / temperature)
    nll = metrics.per_example_nll(log_probs, labels).mean().item()
    conf, pred = log_probs.exp().max(-1)
    correct = (pred == labels).float()
    return nll, metrics.ece_from_confidence(conf, correct, n_bins), conf, correct


def calibrate(
    predictor: BasePredictor,
    val_loader: Iterable,
    method: str = "temperature",
    *,
    plot: str | Path | None = None,
    max_iter: int = 100,
) -> CalibrationResult:
    """Fit ``predictor.temperature`` on ``val_loader`` (labels required) and set it.

    ``plot``: path of a PNG reliability diagram before/after. The validation NLL
    after is ≤ the NLL before (the previous temperature is kept otherwise).
    """
    if method not in METHODS:
        raise BayesifyError(f"unknown calibration method {method!r}; available: {METHODS}")
    logits, labels = _collect(predictor, val_loader)
    if labels is None:
        raise BayesifyError("calibrate: the validation loader yields no labels; it must yield "
                            "(x, y) batches (or mappings with 'labels')")
    if labels.numel() == 0 or logits.shape[1] == 0:
        raise BayesifyError("calibrate: the validation loader produced no examples; pass a "
                            "loader with at least one labelled batch")
    labels = check_labels(labels, logits.shape[-1], where="calibrate")
    if labels.shape[0] != logits.shape[1]:
        raise BayesifyError(f"calibrate: {labels.shape[0]} labels for {logits.shape[1]} examples")
    check_finite_logits(logits, where="calibrate")
    previous = float(predictor.temperature)
    optimum = fit_temperature(logits, labels, max_iter=max_iter)
    nll_before, ece_before, conf_before, correct_before = calibration_stats(logits, labels, previous)
    nll_opt = calibration_stats(logits, labels, optimum)[0]
    kept = not nll_opt < nll_before
    temperature = previous if kept else optimum
    nll_after, ece_after, conf_after, correct_after = calibration_stats(logits, labels, temperature)
    predictor.temperature = temperature
    plot_path = None
    if plot is not None:
        plot_path = str(metrics.save_reliability_diagram(
            {f"before (T={previous:.3g})": (conf_before, correct_before),
             f"after (T={temperature:.3g})": (conf_after, correct_after)}, plot))
    return CalibrationResult(
        method=method, temperature=temperature, previous_temperature=previous,
        optimum_temperature=optimum, kept_previous=kept, nll_before=nll_before,
        nll_after=nll_after, ece_before=ece_before, ece_after=ece_after,
        n=int(labels.numel()), plot=plot_path,
    )
