"""Figures a practitioner keeps: reliability with its support, uncertainty ID vs OOD.

- :func:`save_reliability_diagram`: per equal-width confidence bin, a bar of the
  accuracy (one bar per method, side by side) with the number of examples written
  on it; bins with fewer than ``min_count`` examples are drawn hatched and faint
  (their accuracy is noise), empty bins are not drawn at all (no line jumps across
  them). Below it, the confidence histogram (examples per bin) with each method's
  mean confidence (dashed) and accuracy (solid): where the data are.
- :func:`save_uncertainty_histograms`: one row per method, predictive entropy and
  mutual information (the epistemic part, where a posterior differs from a single
  network) in distribution vs OOD, each panel with its OOD AUROC; a method whose
  mutual information carries no signal (a single network) says so instead of
  drawing noise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from bayesify import metrics

#: bins with fewer examples are drawn hatched: their accuracy is mostly noise
MIN_COUNT = 10
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:gray", "tab:olive", "tab:cyan")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_reliability_diagram(curves: dict[str, tuple[torch.Tensor, torch.Tensor]],
                             path: str | Path, n_bins: int = 15, *,
                             min_count: int = MIN_COUNT) -> Path:
    """PNG reliability diagram + confidence histogram; ``curves[label] = (confidence, correct)``."""
    return _save(reliability_figure(curves, n_bins, min_count=min_count), path, dpi=130)


def _save(fig: Any, path: str | Path, *, dpi: int = 120) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def reliability_figure(curves: dict[str, tuple[torch.Tensor, torch.Tensor]], n_bins: int = 15,
                       *, min_count: int = MIN_COUNT) -> Any:
    """The figure of :func:`save_reliability_diagram` (axes: diagram, confidence histogram)."""
    plt = _pyplot()
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(5.2, 6.2), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 1.3]})
    width = 1.0 / n_bins
    bar = width / max(len(curves), 1)
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    edges = torch.linspace(0, 1, n_bins + 1).numpy()
    for j, (label, (conf, correct)) in enumerate(curves.items()):
        color = COLORS[j % len(COLORS)]
        conf, correct = conf.double().flatten(), correct.double().flatten()
        bins = metrics.reliability_bins(conf, correct, n_bins)
        ece = metrics.ece_from_confidence(conf, correct, n_bins)
        for centre, _, acc, count in bins:
            left = centre - width / 2 + j * bar
            sparse = count < min_count
            ax.bar(left, acc, width=bar, align="edge", color=color, edgecolor=color,
                   alpha=0.3 if sparse else 0.75, hatch="///" if sparse else None, lw=0.5)
            ax.text(left + bar / 2, min(acc, 0.93) + 0.01, str(count), ha="center",
                    va="bottom", fontsize=5.5, rotation=90, color="black")
        ax.bar(0, 0, width=0, color=color, label=f"{label} (ECE {ece:.3f}, n={conf.numel()})")
        counts = [0] * n_bins
        for centre, _, _, count in bins:
            counts[min(int(centre * n_bins), n_bins - 1)] = count
        hist.bar(edges[:-1] + j * bar, counts, width=bar, align="edge", color=color, alpha=0.75)
        hist.axvline(conf.mean().item(), color=color, ls="--", lw=1)
        hist.axvline(correct.mean().item(), color=color, ls="-", lw=1)
    ax.set_ylabel("accuracy in the bin")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_title("reliability diagram (numbers: examples per bin;\n"
                 f"hatched: < {min_count} examples)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    hist.set_xlabel("confidence (max probability)")
    hist.set_ylabel("examples")
    hist.set_yscale("log")  # one example in a bin stays visible next to thousands
    hist.set_ylim(bottom=0.7)
    hist.set_title("confidence histogram (dashed: mean confidence, solid: accuracy)", fontsize=8)
    fig.tight_layout()
    return fig


def _as_groups(splits: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """``{split: {"entropy": t[, "epistemic": t]}}`` from tensors (entropy only) or dicts."""
    return {s: (v if isinstance(v, dict) else {"entropy": v}) for s, v in splits.items()}


def save_uncertainty_histograms(groups: dict[str, dict[str, Any]], path: str | Path,
                                num_classes: int) -> Path:
    """PNG: rows = methods; columns = predictive entropy and mutual information (when
    given), one histogram per split. ``groups[method][split]`` is a tensor of entropies
    or ``{"entropy": [N], "epistemic": [N]}``; the first split is taken as in
    distribution and the others' OOD AUROC against it is shown."""
    return _save(uncertainty_figure(groups, num_classes), path)


def uncertainty_figure(groups: dict[str, dict[str, Any]], num_classes: int) -> Any:
    """The figure of :func:`save_uncertainty_histograms` (axes ``[methods × kinds]``)."""
    plt = _pyplot()
    groups = {m: _as_groups(s) for m, s in groups.items()}
    kinds = ["entropy"] + (["epistemic"] if any("epistemic" in v for s in groups.values()
                                                 for v in s.values()) else [])
    mi_max = max([float(v["epistemic"].max()) for s in groups.values() for v in s.values()
                  if "epistemic" in v and v["epistemic"].numel()] + [1e-3])
    fig, axes = plt.subplots(len(groups), len(kinds), figsize=(4.2 * len(kinds), 2.9 * len(groups)),
                             squeeze=False)
    titles = {"entropy": "predictive entropy (nats)", "epistemic": "mutual information (nats)"}
    for row, (method, splits) in zip(axes, groups.items()):
        for ax, kind in zip(row, kinds):
            values = {s: v[kind].double().flatten() for s, v in splits.items() if kind in v}
            top = math.log(num_classes) if kind == "entropy" else mi_max
            bins = torch.linspace(0, top, 31).numpy()
            first = next(iter(values.values()), None)
            scores = [metrics.ood_auroc(first, v) for v in list(values.values())[1:]]
            if first is None or not metrics.has_signal(*values.values()):
                what = "epistemic signal\n(MI ≈ 0 everywhere: the members agree)" \
                    if kind == "epistemic" else "spread in the entropy"
                ax.text(0.5, 0.5, f"no {what}",
                        ha="center", va="center", transform=ax.transAxes, fontsize=9)
                ax.set_yticks([])
            else:
                for j, (split, v) in enumerate(values.items()):
                    ax.hist(v.clamp(0, top).numpy(), bins=bins, density=True, alpha=0.45,
                            color=COLORS[j % len(COLORS)], label=f"{split} (n={v.numel()})")
                ax.legend(fontsize=7)
            auc = ", ".join("n/a" if s is None else f"{s:.3f}" for s in scores)
            ax.set_title(f"{method}: {kind if kind == 'entropy' else 'MI'}"
                         + (f" — OOD AUROC {auc}" if scores else ""), fontsize=9)
            ax.set_xlabel(titles[kind])
    fig.tight_layout()
    return fig
