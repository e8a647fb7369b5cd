"""``report``: the whole evaluation protocol for several predictors as one tidy table + PNGs.

Rows (all with the same keys, ``None`` where a column does not apply):

* ``evaluation="clean"``, ``level=0``: accuracy, NLL, ECE, Brier, entropy split
  into aleatoric (E_m H(p_m)) and epistemic (MI) on the clean test set;
* ``evaluation="ood"``: the same entropies on the OOD set plus OOD AUROC of
  entropy and MI and the area under the CDF of normalised OOD entropy;
* ``evaluation=<corruption>``, ``level=γ/p/degrees``: the clean-row columns on the
  corrupted test set, one row per severity;
* ``evaluation="fgsm"``, ``level=ε``: accuracy, NLL and entropies under FGSM on
  the predictive mean (skipped, with ``note``, for predictors without a
  differentiable path).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from bayesify import plots
from bayesify.core.batch import split_batch
from bayesify.errors import BayesifyError
from bayesify.evaluation.adversarial import fgsm_sweep
from bayesify.evaluation.corruptions import DEFAULT_SWEEPS
from bayesify.evaluation.scoring import (
    corruption_sweep,
    ood_scores,
    predictive_statistics,
    summarize,
)
from bayesify.predict.predictor import BasePredictor

TABLE_KEYS = (
    "method", "evaluation", "level", "accuracy", "nll", "ece", "brier", "entropy", "aleatoric",
    "epistemic", "ood_auroc_entropy", "ood_auroc_mi", "ood_entropy_cdf_auc", "note",
)
DEFAULT_EPSILONS = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)


def _row(method: str, evaluation: str, level: float, values: dict[str, Any] | None = None,
         **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(TABLE_KEYS)
    row.update({k: v for k, v in {**(values or {}), **extra}.items() if k in TABLE_KEYS})
    row.update(method=method, evaluation=evaluation, level=float(level))
    return row


def _image_batches(loader: Iterable) -> bool:
    """Whether the loader's inputs are one floating tensor per batch (images)."""
    for raw in loader:
        batch = split_batch(raw)
        return (len(batch.args) == 1 and not batch.kwargs
                and isinstance(batch.args[0], torch.Tensor) and batch.args[0].is_floating_point())
    return False


def _as_dataset(loader: Iterable) -> TensorDataset:
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, TensorDataset):
        return dataset
    xs, ys = [], []
    for raw in loader:  # (x, y) pairs or image mappings ({"image": x, "label": y})
        batch = split_batch(raw)
        xs.append(batch.args[0])
        ys.append(batch.require_labels("report"))
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def report(
    predictors: dict[str, BasePredictor],
    loaders: dict[str, Iterable],
    *,
    out_dir: str | Path | None = None,
    sweeps: dict[str, Sequence[float]] | None = None,
    fgsm_epsilons: Sequence[float] | None = DEFAULT_EPSILONS,
    clamp: tuple[float, float] | None = (0.0, 1.0),
    seed: int = 0,
    n_bins: int = 15,
) -> list[dict[str, Any]]:
    """Evaluate every predictor on ``loaders["test"]`` (and ``loaders["ood"]`` if present).

    ``sweeps``: ``{corruption: levels}`` (default :data:`DEFAULT_SWEEPS`; ``{}`` to
    skip); ``fgsm_epsilons``: ε grid (``None`` to skip); ``clamp``: valid input
    range for FGSM. With ``out_dir`` the table is written to ``report.json`` and the
    figures ``reliability.png``, ``uncertainty_hist.png`` (entropy and MI, ID vs OOD),
    ``uncertainty_<corruption>.png`` and ``fgsm.png``. Returns the tidy table.
    """
    if "test" not in loaders:
        raise BayesifyError(f"report needs loaders['test']; got keys {sorted(loaders)}")
    if not predictors:
        raise BayesifyError("report needs at least one predictor")
    sweeps = DEFAULT_SWEEPS if sweeps is None else sweeps
    if (sweeps or fgsm_epsilons) and not _image_batches(loaders["test"]):
        warnings.warn("report: corruption sweeps and FGSM perturb image tensors; the test "
                      "loader yields other inputs (e.g. token mappings), so only the clean "
                      "and OOD rows are computed (pass sweeps={}, fgsm_epsilons=None to "
                      "silence this)", stacklevel=2)
        sweeps, fgsm_epsilons = {}, None
    test_set = _as_dataset(loaders["test"]) if sweeps else None
    table: list[dict[str, Any]] = []
    curves: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    histograms: dict[str, dict[str, torch.Tensor]] = {}
    num_classes = 0
    for name, predictor in predictors.items():
        stats = predictive_statistics(predictor, loaders["test"])
        num_classes = stats["probs"].shape[-1]
        conf, pred = stats["probs"].max(-1)
        curves[name] = (conf, (pred == stats["labels"]).float())
        table.append(_row(name, "clean", 0.0, summarize(stats, n_bins=n_bins)))
        if loaders.get("ood") is not None:
            ood = predictive_statistics(predictor, loaders["ood"])
            scores = ood_scores(stats, ood)
            table.append(_row(name, "ood", 0.0, scores, entropy=scores["ood_entropy"],
                              aleatoric=scores["ood_aleatoric"], epistemic=scores["ood_epistemic"]))
            histograms[name] = {
                "in distribution": {"entropy": stats["entropy"], "epistemic": stats["epistemic"]},
                "OOD": {"entropy": ood["entropy"], "epistemic": ood["epistemic"]}}
        for kind, levels in sweeps.items():
            for r in corruption_sweep(predictor, test_set, kind, levels, seed=seed, n_bins=n_bins):
                table.append(_row(name, kind, r["level"], r))
        if fgsm_epsilons:
            try:
                rows = fgsm_sweep(predictor, loaders["test"], fgsm_epsilons, clamp=clamp)
            except BayesifyError as err:
                table.append(_row(name, "fgsm", math.nan, note=str(err)))
            else:
                table.extend(_row(name, "fgsm", r["epsilon"], r) for r in rows)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(table, indent=1))
        plots.save_reliability_diagram(curves, out / "reliability.png", n_bins)
        if histograms:
            plots.save_uncertainty_histograms(histograms, out / "uncertainty_hist.png", num_classes)
        for kind in sweeps:
            save_uncertainty_sweep(table, kind, out / f"uncertainty_{kind}.png")
        if fgsm_epsilons:
            save_fgsm_curves(table, out / "fgsm.png")
    return table


def _series(table: list[dict[str, Any]], evaluation: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in table:
        if row["evaluation"] == evaluation and row.get("entropy") is not None:
            out.setdefault(row["method"], []).append(row)
    return {m: sorted(rows, key=lambda r: r["level"]) for m, rows in out.items()}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_uncertainty_sweep(table: list[dict[str, Any]], evaluation: str, path: str | Path) -> Path:
    """Mean predictive entropy vs severity, stacked as aleatoric + epistemic, one panel per method."""
    plt = _pyplot()
    series = _series(table, evaluation)
    if not series:
        raise BayesifyError(f"no rows with evaluation={evaluation!r} in the table")
    cols = min(4, len(series))
    rows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows), squeeze=False,
                             sharey=True)
    for ax, (method, points) in zip(axes.flat, series.items()):
        levels = [p["level"] for p in points]
        ax.stackplot(levels, [p["aleatoric"] for p in points], [p["epistemic"] for p in points],
                     labels=["aleatoric E[H]", "epistemic MI"], alpha=0.7)
        ax.plot(levels, [p["entropy"] for p in points], "k-", lw=1, label="total H")
        ax.set_title(method, fontsize=9)
        ax.set_xlabel(evaluation)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    axes[0][0].set_ylabel("mean entropy (nats)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_fgsm_curves(table: list[dict[str, Any]], path: str | Path) -> Path:
    """Accuracy and entropy (total solid, epistemic dashed) vs FGSM ε."""
    plt = _pyplot()
    series = _series(table, "fgsm")
    fig, (ax_acc, ax_ent) = plt.subplots(1, 2, figsize=(9, 3.4))
    for method, points in series.items():
        eps = [p["level"] for p in points]
        (line,) = ax_acc.plot(eps, [p["accuracy"] for p in points], "o-", ms=3, label=method)
        ax_ent.plot(eps, [p["entropy"] for p in points], "o-", ms=3, color=line.get_color())
        ax_ent.plot(eps, [p["epistemic"] for p in points], "--", color=line.get_color())
    ax_acc.set_xlabel("FGSM ε")
    ax_acc.set_ylabel("accuracy")
    ax_ent.set_xlabel("FGSM ε")
    ax_ent.set_ylabel("entropy (solid) / MI (dashed)")
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
