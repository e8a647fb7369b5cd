"""``bayesify demo``: MAP vs bayesified posteriors on the embedded digits protocol.

Trains a small CNN on digits 0–4 (the "pretrained" network), bayesifies it with
each requested family, fine-tunes only the posterior, and compares accuracy,
NLL, ECE, Brier, OOD AUROC (digits 5–9) and NLL on a Gaussian-corrupted test set.
Every family runs with its library defaults (no per-family recipe): ``fit`` with the
validation split, so each family tunes its predictive-scale knob on it.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import plots
from bayesify.core.factory import bayesify
from bayesify.data.digits import digits_loaders, load_digits_splits
from bayesify.data.models import DigitsCNN, train_map
from bayesify.evaluation.corruptions import gaussian_mix
from bayesify.predict.predictor import BasePredictor, ModelPredictor
from bayesify.train.evaluate import per_example_stats
from bayesify.train.loop import fit

COLUMNS = ("accuracy", "nll", "ece", "brier", "ood_auroc_entropy", "ood_auroc_mi", "corrupt_nll",
           "fit_seconds")
CORRUPTION_GAMMA = 0.5


def corrupted_loader(dataset: TensorDataset, *, gamma: float, seed: int, batch_size: int = 512) -> DataLoader:
    x, y = dataset.tensors
    return DataLoader(TensorDataset(gaussian_mix(x, gamma, seed=seed), y), batch_size=batch_size)


def evaluate_predictor(predictor: BasePredictor, loaders: dict[str, DataLoader], corrupt: DataLoader,
                       *, progress: bool = True) -> dict[str, Any]:
    out = predictor.evaluate(loaders["test"], loaders["ood"], progress=progress)
    corrupt_stats = predictor.evaluate(corrupt, progress=progress)
    out["corrupt_nll"] = corrupt_stats["nll"]
    out["corrupt_accuracy"] = corrupt_stats["accuracy"]
    return out


def run_demo(
    *,
    out_dir: str | Path = "bayesify-demo",
    methods: list[str] | tuple[str, ...] = ("ibnn", "laplace"),
    seed: int = 0,
    map_epochs: int = 40,
    epochs: int | None = None,
    progress: bool = True,
    plots: bool = True,
) -> dict[str, dict[str, Any]]:
    """Run the demo; returns (and writes to ``out_dir/results.json``) one dict per method.

    Every family: defaults, ``epochs`` epochs (None, the default: ``fit``'s step budget) and the
    validation split as ``val_loader``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    splits = load_digits_splits(seed=seed)
    loaders = digits_loaders(splits, batch_size=64, seed=seed)
    corrupt = corrupted_loader(splits.test, gamma=CORRUPTION_GAMMA, seed=seed + 1)

    start = time.perf_counter()
    base = train_map(DigitsCNN(splits.num_classes), loaders["train"], epochs=map_epochs,
                     seed=seed, progress=progress)
    results: dict[str, dict[str, Any]] = {}
    predictors: dict[str, BasePredictor] = {"map": ModelPredictor(base)}
    results["map"] = evaluate_predictor(predictors["map"], loaders, corrupt,
                                        progress=progress)
    results["map"]["fit_seconds"] = time.perf_counter() - start

    for name in methods:
        torch.manual_seed(seed)
        fit_kwargs: dict[str, Any] = {"val_loader": loaders["val"]}
        if epochs is not None:
            fit_kwargs["epochs"] = epochs
        start = time.perf_counter()
        bnn = bayesify(copy.deepcopy(base), name)
        fit(bnn, loaders["train"], progress=progress, **fit_kwargs)
        predictors[name] = bnn.predictor()
        results[name] = evaluate_predictor(predictors[name], loaders, corrupt, progress=progress)
        results[name]["fit_seconds"] = time.perf_counter() - start

    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    if plots:
        _plots(predictors, loaders, out_dir, splits.num_classes)
    return results


def _plots(predictors: dict[str, BasePredictor], loaders: dict[str, DataLoader], out_dir: Path, num_classes: int) -> None:
    curves, groups = {}, {}
    for name, predictor in predictors.items():
        test = per_example_stats(predictor, loaders["test"], device=predictor.device)
        ood = per_example_stats(predictor, loaders["ood"], device=predictor.device, labels=False)
        curves[name] = (test["confidence"], test["correct"])
        groups[name] = {"in distribution (0–4)": {k: test[k] for k in ("entropy", "epistemic")},
                        "OOD (5–9)": {k: ood[k] for k in ("entropy", "epistemic")}}
    plots.save_reliability_diagram(curves, out_dir / "reliability.png")
    plots.save_uncertainty_histograms(groups, out_dir / "uncertainty_hist.png", num_classes)


def _cell(row: dict[str, Any], column: str) -> str:
    """A number to 4 places; "n/a" for a score without signal (e.g. a single network's MI)."""
    value = row.get(column, "")
    if value is None:
        return "n/a"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


# which way is better for each compared metric (fit_seconds is a cost, not a result)
HIGHER_IS_BETTER = {"accuracy": True, "nll": False, "ece": False, "brier": False,
                    "ood_auroc_entropy": True, "ood_auroc_mi": True, "corrupt_nll": False}


def compare_to_map(results: dict[str, dict[str, Any]], *, places: int = 4) -> list[str]:
    """One line per posterior: the metrics where it beats MAP, ties, and loses to it.

    Values are compared as the table prints them (``places`` decimals), so a "tie" is a tie
    on the page. A loss is said in words: the demo never shows a posterior that is worse than
    the network it started from without saying so.
    """
    base = results.get("map", {})
    lines = []
    for name, row in results.items():
        if name == "map":
            continue
        better, worse, tied = [], [], []
        for metric, higher in HIGHER_IS_BETTER.items():
            mine, theirs = row.get(metric), base.get(metric)
            if not isinstance(mine, float) or not isinstance(theirs, float):
                continue  # n/a: a single network has no mutual information
            a, b = round(mine, places), round(theirs, places)
            shown = f"{metric} {mine:.{places}f} vs {theirs:.{places}f}"
            if a == b:
                tied.append(metric)
            elif (a > b) == higher:
                better.append(shown)
            else:
                worse.append(shown)
        lines.append(f"{name} vs map: better on {', '.join(better) or 'nothing'}; "
                     f"worse on {', '.join(worse) or 'nothing'}"
                     + (f"; tied on {', '.join(tied)}" if tied else ""))
        if worse:
            lines.append(f"  note: on this run {name} is worse than the MAP network it started "
                         f"from on {len(worse)} of {len(better) + len(worse) + len(tied)} metrics; "
                         "a posterior is not automatically better than its network")
    return lines


def format_table(results: dict[str, dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    header = ["method", *columns]
    rows = [header] + [
        [name] + [_cell(r, c) for c in columns]
        for name, r in results.items()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)
