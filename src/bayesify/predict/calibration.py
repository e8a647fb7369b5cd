"""Temperature scaling of a Bayesian predictive (Guo et al. 2017, on the predictive).

One temperature T acts on the *predictive's log-probabilities* (for every family: the
member mixture ``log p̄ = logsumexp_m log softmax(f_m) − log M``, or the link's output of
a Gaussian predictive — probit or Laplace bridge); it minimises the validation NLL of

    NLL(T) = −(1/N) Σ_n log softmax(log p̄(x_n) / T)[y_n],

so a broad posterior can be sharpened where its predictive is confident and stays broad
where it is not (dividing member logits or the Gaussian's moments cannot sharpen a
broad predictive).

optimised by LBFGS over log T (so T stays positive), started from the best of
a coarse grid and kept in ``T_BOUNDS``. The fit never makes the validation NLL
worse: when the optimum is not better than the predictor's current temperature,
that one is kept. After a validation search (``fit(val_loader=...)`` / ``tune``) chose the
temperature jointly with the posterior's knob, :func:`calibrate` refuses to move it
(the search saw shift, calibration sees clean data only) unless ``force=True``.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bayesify import metrics, plots
from bayesify.core.checks import check_finite_logits, check_labels
from bayesify.core.prediction import Prediction
from bayesify.errors import BayesifyError
from bayesify.progress import is_rank_zero

if TYPE_CHECKING:
    from bayesify.predict.predictor import BasePredictor

logger = logging.getLogger(__name__)

METHODS = ("temperature",)
#: coarse grid of log T the LBFGS run starts from (T in [1/20, 20])
_LOG_T_GRID = torch.linspace(-math.log(20.0), math.log(20.0), 13)
#: T is kept in this range: on a small validation set the mixture NLL can keep falling
#: as T → 0 (the members' hard votes become the probabilities), which overfits
T_BOUNDS = (1e-2, 1e2)
#: the temperature grid of the one-SE choice
_GRID_RANGE = (0.05, 20.0)
#: fewer labelled examples than this cannot tell temperatures apart (one example sends
#: T to a bound: 100 if it is misclassified): refused
MIN_CALIBRATION_EXAMPLES = 5
RULES = ("one_se", "min")


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
    #: "one_se" or "min" (see choose_temperature)
    rule: str = "one_se"
    #: the temperature grid and its validation NLL (one_se rule)
    curve: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _collect(predictor: BasePredictor, loader: Iterable, *,
             progress: bool = True) -> tuple[Prediction, torch.Tensor | None]:
    """``predictor.collect_predictions`` with an empty loader turned into a clear error."""
    try:
        if len(loader) == 0:  # type: ignore[arg-type]
            raise BayesifyError("calibrate: the validation loader is empty (len 0); pass a "
                                "loader with at least one labelled batch")
    except TypeError:  # an unsized iterable: found out below
        pass
    try:
        return predictor.collect_predictions(loader, where="calibrate", progress=progress)
    except BayesifyError as err:
        if "no batches" in str(err):
            raise BayesifyError("calibrate: the validation loader produced no batches; pass a "
                                "loader with at least one labelled batch") from err
        raise


def _nll(prediction: Prediction, labels: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """``[N]`` NLL of the predictive at temperature ``t`` (differentiable in a tensor t)."""
    return prediction.scaled(t).nll(labels)


def mixture_nll(member_logits: torch.Tensor, labels: torch.Tensor, log_t: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the tempered mixture at temperature ``exp(log_t)``; ``[M, N, C]``,
    ``[N]`` → scalar: ``−log softmax(log p̄ / T)[y]`` with
    ``log p̄ = logsumexp_m log softmax(f_m) − log M``. Differentiable in ``log_t``.
    """
    log_p = metrics.mixture_log_probs(member_logits)
    return metrics.per_example_nll(torch.log_softmax(log_p / log_t.exp(), dim=-1),
                                   labels).mean()


def fit_temperature(member_logits: torch.Tensor | Prediction, labels: torch.Tensor, *,
                    max_iter: int = 100) -> float:
    """argmin_T of the validation NLL (LBFGS on log T from the best grid point).

    ``member_logits [M, N, C]`` (the mixture NLL, :func:`mixture_nll`) or a raw
    :class:`Prediction` (members or a Gaussian over the logits: T acts on ``log p̄``)
    must be finite, and ``labels [N]`` class indices in ``[0, C)`` with ``N > 0``
    (:class:`BayesifyError` otherwise).
    """
    prediction = _as_prediction(member_logits, "fit_temperature")
    logits = prediction.member_logits if not prediction.is_gaussian else prediction.mean
    labels = check_labels(labels.detach(), logits.shape[-1], where="fit_temperature")
    labels = labels.to(logits.device)

    prediction = prediction.untempered
    with torch.no_grad():
        _ = prediction.raw_log_probs  # computed once, tempered at every step

    def nll(log_t: torch.Tensor) -> torch.Tensor:
        return _nll(prediction, labels, log_t.exp()).mean()

    with torch.no_grad():
        grid = torch.stack([nll(t) for t in _LOG_T_GRID])
    start = _LOG_T_GRID[int(torch.nan_to_num(grid, nan=math.inf).argmin())]
    log_t = start.clone().to(logits.device).requires_grad_(True)
    optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter,
                                  line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nll(log_t)
        loss.backward()
        return loss

    optimizer.step(closure)
    value = float(log_t.detach().exp())
    if not math.isfinite(value):
        return float(start.exp())
    value = min(max(value, T_BOUNDS[0]), T_BOUNDS[1])
    with torch.no_grad():
        clamped = nll(torch.tensor(math.log(value)))
        at_start = nll(start)
    return value if clamped <= at_start else float(start.exp())


def _as_prediction(value: torch.Tensor | Prediction, where: str) -> Prediction:
    prediction = value if isinstance(value, Prediction) else None
    if prediction is None:
        if value.dim() != 3 or value.shape[1] == 0:
            raise BayesifyError(f"{where} needs member logits [M, N, C] with N > 0, got "
                                f"shape {tuple(value.shape)}")
        prediction = Prediction(value.detach().float())
    tensor = prediction.mean if prediction.is_gaussian else prediction.member_logits
    check_finite_logits(tensor, where=where)
    if prediction.is_gaussian:
        check_finite_logits(prediction.variance, where=where)
    return prediction


def choose_temperature(prediction: Prediction, labels: torch.Tensor, *, previous: float,
                       optimum: float, rule: str = "one_se") -> tuple[float, dict[str, Any]]:
    """The temperature to use: the NLL optimum (``rule='min'``), or — the default — the
    softest T whose validation NLL is within one paired standard error of the optimum
    and not above the NLL at ``previous`` (:func:`bayesify.core.selection.choose`). On a
    small or perfectly classified split the optimum runs towards T → 0 (hard votes),
    which is catastrophic under shift; the rule keeps the softest T the split cannot
    tell apart from it."""
    from bayesify.core.selection import choose

    if rule == "min":
        return optimum, {}
    grid = sorted({*torch.logspace(math.log10(_GRID_RANGE[0]), math.log10(_GRID_RANGE[1]), 41,
                                   dtype=torch.float64).tolist(), optimum, previous})
    with torch.no_grad():
        per = [_nll(prediction, labels, t).double() for t in grid]
    ceiling = float(per[grid.index(previous)].mean())
    index = choose(grid, per, rule=rule, prefer="largest", paired=True, ceiling=ceiling)
    return grid[index], {"temperature_grid": grid,
                         "temperature_val_nll": [float(v.mean()) for v in per]}


def calibration_stats(member_logits: torch.Tensor | Prediction, labels: torch.Tensor,
                      temperature: float, n_bins: int = 15) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """``(nll, ece, confidence [N], correct [N])`` of the predictive at ``temperature``."""
    prediction = (member_logits if isinstance(member_logits, Prediction)
                  else Prediction(member_logits.float()))
    log_probs = prediction.scaled(temperature).log_probs
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
    rule: str = "one_se",
    progress: bool = True,
    force: bool = False,
) -> CalibrationResult:
    """Fit ``predictor.temperature`` on ``val_loader`` (labels required) and set it.

    ``rule``: ``'one_se'`` (default: the softest temperature within one paired standard
    error of the NLL optimum, see :func:`choose_temperature`) or ``'min'`` (the
    optimum). ``plot``: path of a PNG reliability diagram before/after. The
    validation NLL after is ≤ the NLL before (the previous temperature is kept
    otherwise). Works on members and on Gaussian predictives (T acts on ``log p̄``).
    ``force``: a temperature chosen by the validation search (``fit(val_loader=...)``,
    ``tune``) is refused unless ``force=True`` — the search chose it with the posterior's
    knob on clean *and* shifted data, and a clean-only re-fit would undo that.
    ``progress``: a bar over the validation batches (rank 0); the chosen temperature is
    logged at INFO (``bayesify.predict.calibration``).
    """
    if method not in METHODS:
        raise BayesifyError(f"unknown calibration method {method!r}; available: {METHODS}")
    if rule not in RULES:
        raise BayesifyError(f"calibrate: rule must be one of {list(RULES)}, got {rule!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise BayesifyError(f"calibrate: max_iter must be a positive integer, got {max_iter!r}")
    if searched_temperature(predictor) and not force:
        raise BayesifyError(
            f"calibrate: the temperature {float(predictor.temperature):.4g} was chosen by the "
            "validation search with the posterior's knob (fit(val_loader=...) or tune), on clean "
            "and shifted validation data; re-fitting it on clean data alone would undo that "
            "choice. Keep it, re-run tune(bnn, val_loader), or pass force=True to calibrate "
            "anyway (`bayesify calibrate --force`)")
    start = time.perf_counter()
    prediction, labels = _collect(predictor, val_loader, progress=progress)
    if labels is None:
        raise BayesifyError("calibrate: the validation loader yields no labels; it must yield "
                            "(x, y) batches (or mappings with 'labels')")
    rows = prediction.mean.shape[0] if prediction.is_gaussian else prediction.member_logits.shape[1]
    if labels.numel() == 0 or rows == 0:
        raise BayesifyError("calibrate: the validation loader produced no examples; pass a "
                            "loader with at least one labelled batch")
    classes = (prediction.mean if prediction.is_gaussian else prediction.member_logits).shape[-1]
    labels = check_labels(labels, classes, where="calibrate")
    if labels.shape[0] != rows:
        raise BayesifyError(f"calibrate: {labels.shape[0]} labels for {rows} examples")
    if rows < MIN_CALIBRATION_EXAMPLES:
        raise BayesifyError(
            f"calibrate: {rows} labelled example(s) cannot choose a temperature (with one, "
            "the NLL is minimised at a bound of the search); pass a validation loader with at "
            f"least {MIN_CALIBRATION_EXAMPLES} examples (hundreds for a reliable fit)")
    prediction = _as_prediction(prediction, "calibrate")
    previous = float(predictor.temperature)
    optimum = fit_temperature(prediction, labels, max_iter=max_iter)
    chosen, curve = choose_temperature(prediction, labels, previous=previous, optimum=optimum,
                                       rule=rule)
    nll_before, ece_before, conf_before, correct_before = calibration_stats(prediction, labels,
                                                                            previous)
    nll_chosen = calibration_stats(prediction, labels, chosen)[0]
    kept = not nll_chosen < nll_before
    temperature = previous if kept else chosen
    nll_after, ece_after, conf_after, correct_after = calibration_stats(prediction, labels,
                                                                        temperature)
    predictor.temperature = temperature
    if getattr(predictor, "bnn", None) is not None:
        predictor.bnn.temperature_source = "calibrate"
    if is_rank_zero():
        logger.info("calibrate: temperature %.4g (%s; optimum %.4g, rule %r) on %d validation "
                    "examples, NLL %.4f -> %.4f, in %.1f s", temperature,
                    "kept the previous" if kept else f"was {previous:.4g}", optimum, rule, rows,
                    nll_before, nll_after, time.perf_counter() - start)
    if is_rank_zero():  # only rank 0 speaks
        _warn_at_bound(temperature, rows)
    plot_path = None
    if plot is not None:
        plot_path = str(plots.save_reliability_diagram(
            {f"before (T={previous:.3g})": (conf_before, correct_before),
             f"after (T={temperature:.3g})": (conf_after, correct_after)}, plot))
    return CalibrationResult(
        method=method, temperature=temperature, previous_temperature=previous,
        optimum_temperature=optimum, kept_previous=kept, nll_before=nll_before,
        nll_after=nll_after, ece_before=ece_before, ece_after=ece_after,
        n=int(labels.numel()), plot=plot_path, rule=rule, curve=curve,
    )


def searched_temperature(predictor: BasePredictor) -> bool:
    """Whether ``predictor`` predicts at the temperature a validation search chose (its
    posterior's ``temperature_source`` is ``"search"`` and no other temperature was set
    on the predictor)."""
    bnn = getattr(predictor, "bnn", None)
    if bnn is None or getattr(bnn, "temperature_source", None) != "search":
        return False
    own = getattr(predictor, "_temperature", None)
    return own is None or own == bnn.state.value("temperature")


#: how close (relative) to a bound counts as on it: the LBFGS run and the grid's float32
#: values land within ~1e-4 of a bound they are pushed against (0.04999 for 0.05)
BOUND_RTOL = 1e-3


def _warn_at_bound(temperature: float, rows: int) -> None:
    """A temperature at the edge of the search is the data running out, not a fit."""
    edges = (T_BOUNDS[0], _GRID_RANGE[0], _GRID_RANGE[1], T_BOUNDS[1])
    edge = next((e for e in edges if abs(math.log(temperature / e)) < BOUND_RTOL), None)
    if edge is not None:
        warnings.warn(
            f"calibrate: the temperature {temperature:.4g} lies at a bound of the search "
            f"(its bound {edge:g}; {rows} validation examples): "
            "the validation NLL kept improving towards the bound, which usually means too few "
            "or too easy validation examples (or, at the top, a posterior far worse than its "
            "network: the temperature flattens it rather than calibrating it)",
            stacklevel=3)


#: where the temperature acts, recorded in calibration files, saved posteriors and exports:
#: ``softmax(log p̄ / T)`` on the predictive (files without it are of the older, member-logit
#: kind and are refused unless their temperature is 1)
TEMPERATURE_KIND = "predictive"
#: what ``bayesify calibrate`` records to tie ``calibration.json`` to its posterior
POSTERIOR_KEY = "posterior_checksum"


def calibration_record(result: CalibrationResult, posterior_dir: str | Path | None) -> dict[str, Any]:
    """The JSON payload of a calibration file: the result plus the checksum of the saved
    posterior it was fitted on (``None`` for a plain model)."""
    from bayesify.persistence import read_manifest

    payload = result.to_dict()
    payload["temperature_kind"] = TEMPERATURE_KIND
    payload[POSTERIOR_KEY] = (read_manifest(posterior_dir)["checksum"]
                              if posterior_dir is not None else None)
    return payload


def read_calibration_file(path: str | Path, posterior_dir: str | Path) -> float:
    """The temperature of a calibration file, checked: valid JSON, a finite temperature
    > 0, fitted on the posterior now in ``posterior_dir`` (a stale file, e.g. left from
    before a re-fit into the same folder, is refused)."""
    import json

    from bayesify.persistence import read_manifest
    from bayesify.predict.serving import check_temperature

    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BayesifyError(f"{path} is not a readable calibration file ({err}); re-run "
                            "`bayesify calibrate` or delete it") from err
    if not isinstance(payload, dict) or "temperature" not in payload:
        raise BayesifyError(f"{path} holds no temperature; re-run `bayesify calibrate` or "
                            "delete it")
    try:
        temperature = check_temperature(payload["temperature"], where=f"the temperature in {path}")
    except TypeError as err:  # a string or null in the file: a bad file, not a bad call
        raise BayesifyError(str(err)) from None
    if payload.get("temperature_kind") != TEMPERATURE_KIND and temperature != 1.0:
        raise BayesifyError(
            f"{path} holds a temperature of the older kind (T = {temperature:.4g} divided the "
            "members' logits; bayesify now applies it to the predictive's log-probabilities, "
            "softmax(log p̄ / T), which is a different predictive): it is not reinterpreted. "
            f"Re-run `bayesify calibrate --posterior {posterior_dir}` or delete {path.name}")
    current = read_manifest(posterior_dir)["checksum"]
    fitted_on = payload.get(POSTERIOR_KEY)
    if fitted_on != current:
        what = ("records no posterior (written by an older bayesify or for another model)"
                if fitted_on is None else f"was fitted on another posterior ({str(fitted_on)[:12]}…)")
        raise BayesifyError(
            f"{path} {what}; the posterior in {posterior_dir} is {current[:12]}… — the file is "
            "stale (was the run re-fitted into the same folder?). Re-run `bayesify calibrate "
            f"--posterior {posterior_dir}` or delete {path.name}")
    return temperature
