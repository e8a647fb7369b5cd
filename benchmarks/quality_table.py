"""Bootstrap aggregation and the Markdown table of ``benchmarks/quality.py``.

Per seed, every metric is computed on the full test/OOD sets (the point estimate)
and on ``num_boot`` bootstrap resamples of the test points (and, for AUROC, of the
OOD points); the resampled indices are shared by all rows of the seed, so the
replicates of two rows are paired. Over seeds: value = mean over seeds, SE =
sqrt(Σ_s SE_s²)/S (test-point sampling error of that mean), ``seed_std`` = spread
of the per-seed values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from bayesify import metrics

#: (key, header, higher is better)
MAIN_COLUMNS = (
    ("accuracy", "acc", True), ("nll", "NLL", False), ("ece", "ECE", False),
    ("brier", "Brier", False), ("ood_auroc", "OOD AUROC (H)", True),
    ("ood_auroc_mi", "OOD AUROC (MI)", True), ("corrupt_nll", "corrupt NLL", False),
    ("corrupt_acc", "corrupt acc", True),
)
TARGETS = ("nll", "ece", "ood_auroc", "corrupt_nll")


def _ece_boot(conf: torch.Tensor, correct: torch.Tensor, idx: torch.Tensor, n_bins: int = 15
              ) -> torch.Tensor:
    """ECE of every resample: Σ_b |Σ_{i∈b} correct_i − conf_i| / n, ``idx [R, n]`` → ``[R]``."""
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    bins = (torch.bucketize(conf.double(), edges) - 1).clamp(0, n_bins - 1)
    gap = (correct.double() - conf.double())
    out = torch.zeros(idx.shape[0], n_bins, dtype=torch.float64)
    out.scatter_add_(1, bins[idx], gap[idx])
    return out.abs().sum(1) / idx.shape[1]


def seed_metrics(entry: dict[str, Any], idx: torch.Tensor, idx_ood: torch.Tensor
                 ) -> dict[str, tuple[float, torch.Tensor]]:
    """``{metric: (full-sample value, [R] bootstrap replicates)}`` for one row of one seed."""
    test, ood = entry["test"], entry["ood"]
    full = torch.arange(idx.shape[1]).unsqueeze(0)
    full_ood = torch.arange(idx_ood.shape[1]).unsqueeze(0)
    out: dict[str, tuple[float, torch.Tensor]] = {}

    def add(name: str, per_point: torch.Tensor) -> None:
        out[name] = (per_point.double().mean().item(), per_point.double()[idx].mean(1))

    add("accuracy", test["correct"])
    add("nll", test["nll"])
    add("brier", test["brier"])
    out["ece"] = (_ece_boot(test["confidence"], test["correct"], full).item(),
                  _ece_boot(test["confidence"], test["correct"], idx))
    for key, score in (("ood_auroc", "entropy"), ("ood_auroc_mi", "epistemic")):
        value = metrics.auroc(test[score], ood[score])
        reps = torch.tensor([metrics.auroc(test[score][i], ood[score][j])
                             for i, j in zip(idx, idx_ood)], dtype=torch.float64)
        out[key] = (value, reps)
    del full_ood
    nll_all, acc_all = [], []
    for kind, sweep in entry["sweeps"].items():
        add(f"{kind}_nll", sweep["nll"])
        add(f"{kind}_acc", sweep["correct"])
        nll_all.append(sweep["nll"])
        acc_all.append(sweep["correct"])
    if nll_all:
        add("corrupt_nll", torch.stack(nll_all).mean(0))
        add("corrupt_acc", torch.stack(acc_all).mean(0))
    return out


def aggregate(per_seed: list[dict[str, Any]], *, num_boot: int = 200) -> dict[str, Any]:
    """Combine seeds: ``{"rows": {name: {metric: {value, se, seed_std, per_seed}}}, ...}``."""
    names: list[str] = []
    for run in per_seed:
        names.extend(n for n in run["rows"] if n not in names)
    replicates: dict[str, dict[str, list[torch.Tensor]]] = {n: {} for n in names}
    values: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    ses: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    extra: dict[str, dict[str, Any]] = {n: {"errors": [], "fit_seconds": [], "fit_cpu_seconds": [],
                                            "predict_seconds": [], "members": None, "group": None,
                                            "recipe": None, "temperature": [],
                                            "sweep_entropy": {}} for n in names}
    for run in per_seed:
        gen = torch.Generator().manual_seed(10_000 + run["seed"])
        idx = torch.randint(0, run["n_test"], (num_boot, run["n_test"]), generator=gen)
        idx_ood = torch.randint(0, run["n_ood"], (num_boot, run["n_ood"]), generator=gen)
        for name, entry in run["rows"].items():
            info = extra[name]
            info["group"], info["recipe"] = entry["group"], entry["recipe"]
            if "error" in entry:
                info["errors"].append(f"seed {run['seed']}: {entry['error']}")
                continue
            info["members"] = entry["members"]
            for key in ("fit_seconds", "fit_cpu_seconds", "predict_seconds", "temperature"):
                info[key].append(entry[key])
            for kind, sweep in entry["sweeps"].items():
                info["sweep_entropy"].setdefault(kind, []).append(
                    {"entropy": sweep["entropy_by_level"], "epistemic": sweep["epistemic_by_level"]})
            for metric, (value, reps) in seed_metrics(entry, idx, idx_ood).items():
                values[name].setdefault(metric, []).append(value)
                ses[name].setdefault(metric, []).append(reps.std(unbiased=True).item())
                replicates[name].setdefault(metric, []).append(reps)
    rows: dict[str, Any] = {}
    complete = len(per_seed)
    for name in names:
        row: dict[str, Any] = {k: v for k, v in extra[name].items() if k != "sweep_entropy"}
        row["seeds_ok"] = len(extra[name]["fit_seconds"])
        for key in ("fit_seconds", "fit_cpu_seconds", "predict_seconds", "temperature"):
            row[key] = _mean(extra[name][key])
        row["sweep_entropy"] = extra[name]["sweep_entropy"]
        row["metrics"] = {}
        for metric, vals in values[name].items():
            s = len(vals)
            row["metrics"][metric] = {
                "value": sum(vals) / s,
                "se": math.sqrt(sum(se**2 for se in ses[name][metric])) / s,
                "seed_std": float(torch.tensor(vals).std()) if s > 1 else 0.0,
                "per_seed": vals,
            }
        rows[name] = row
    summary = {"rows": rows, "notes": [run.get("notes", {}) for run in per_seed],
               "sweeps": per_seed[0]["sweeps"] if per_seed else {}}
    summary["verdict"] = {t: verdict(rows, replicates, complete, target=t)
                          for t in rows if t.startswith("bayesify:ibnn")}
    return summary


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def verdict(rows: dict[str, Any], replicates: dict[str, dict[str, list[torch.Tensor]]],
            seeds: int, target: str = "bayesify:ibnn") -> dict[str, Any]:
    """For each target metric: best row, iBNN's gap, SE of the best row, paired SE of the gap."""
    out: dict[str, Any] = {}
    if target not in rows or not rows[target]["metrics"]:
        return out
    higher = {key: hi for key, _, hi in MAIN_COLUMNS}
    for metric in TARGETS:
        valid = {n: r["metrics"][metric] for n, r in rows.items()
                 if metric in r["metrics"] and r["seeds_ok"] == seeds}
        if target not in valid:
            continue
        sign = 1.0 if higher[metric] else -1.0
        best = max(valid, key=lambda n: sign * valid[n]["value"])
        gap = sign * (valid[best]["value"] - valid[target]["value"])  # ≥ 0: how far iBNN is behind
        diffs = [a - b for a, b in zip(replicates[target][metric], replicates[best][metric])]
        paired = math.sqrt(sum(d.var(unbiased=True).item() for d in diffs)) / len(diffs)
        out[metric] = {
            "best": best, "best_value": valid[best]["value"], "best_se": valid[best]["se"],
            "ibnn_value": valid[target]["value"], "ibnn_se": valid[target]["se"], "gap": gap,
            "paired_se": paired,
            "within_one_se_of_best": gap <= valid[best]["se"],
            "within_one_paired_se": gap <= paired,
        }
    return out


def _fmt(metric: dict[str, Any] | None, digits: int = 3) -> str:
    if metric is None:
        return "–"
    return f"{metric['value']:.{digits}f} ± {metric['se']:.{digits}f}"


def write_markdown(summary: dict[str, Any]) -> str:
    """Markdown: main table, per-sweep table, iBNN verdict, recipes, timing and notes."""
    rows, meta = summary["rows"], summary.get("meta", {})
    lines = ["# Quality benchmark: digits protocol (classes 0–4 in distribution, 5–9 OOD)", ""]
    if meta:
        lines += [f"Command: `{meta['command']}`  ", (f"Seeds: {meta['seeds']}; bootstrap "
                  f"resamples: {meta['bootstrap']}; torch threads: {meta['threads']}; "
                  f"torch {meta['torch']}; peers: {meta['peers']}  "),
                  (f"Wall time: {meta['wall_seconds']:.0f} s (CPU {meta['cpu_seconds']:.0f} s) "
                  f"on {meta['machine']}, {meta['date']}."), ""]
    lines += [("Values: mean over seeds ± bootstrap SE over test points (sqrt(Σ SE²)/S). "
              "**bold** = best, ° = within one SE of the best row's value."), ""]
    best = _best(rows)
    header = ["method", "M"] + [h for _, h, _ in MAIN_COLUMNS] + ["fit s", "predict s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in rows.items():
        if not row["metrics"]:
            lines.append(f"| {name} | failed: {'; '.join(row['errors'])[:200]} |")
            continue
        cells = [name, str(row["members"])]
        for key, _, _ in MAIN_COLUMNS:
            m = row["metrics"].get(key)
            cell = _fmt(m)
            if m is not None and key in best:
                b = rows[best[key]]["metrics"][key]
                if name == best[key]:
                    cell = f"**{cell}**"
                elif abs(m["value"] - b["value"]) <= b["se"]:
                    cell += " °"
            cells.append(cell)
        cells += [f"{row['fit_seconds']:.1f}", f"{row['predict_seconds']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    sweep_keys = list(summary.get("sweeps", {}))
    if sweep_keys:
        lines += ["", ("NLL / accuracy averaged over each corruption sweep "
                  f"(levels: {summary['sweeps']}):"), ""]
        header = ["method"] + [f"{k} NLL" for k in sweep_keys] + [f"{k} acc" for k in sweep_keys]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for name, row in rows.items():
            if row["metrics"]:
                cells = [name] + [_fmt(row["metrics"].get(f"{k}_nll")) for k in sweep_keys]
                cells += [_fmt(row["metrics"].get(f"{k}_acc")) for k in sweep_keys]
                lines.append("| " + " | ".join(cells) + " |")
    for target, table in summary.get("verdict", {}).items():
        lines += ["", f"## {target} against the best row", "",
                  ("| metric | best row | best | iBNN | gap | SE(best) | paired SE(gap) | "
                  "within 1 SE |"), "|---|---|---|---|---|---|---|---|"]
        for metric, v in table.items():
            lines.append(f"| {metric} | {v['best']} | {v['best_value']:.4f} | {v['ibnn_value']:.4f} "
                         f"| {v['gap']:.4f} | {v['best_se']:.4f} | {v['paired_se']:.4f} | "
                         f"{'yes' if v['within_one_se_of_best'] else 'NO'} |")
    lines += ["", "## Recipes", ""]
    for name, row in rows.items():
        lines.append(f"- `{name}`: `{row['recipe']}`")
    kl = [n["bayesian-torch kl"] for n in summary.get("notes", []) if "bayesian-torch kl" in n]
    if kl:
        lines += ["", "## bayesian-torch KL scaling", "",
                  ("`get_kl_loss` sums each weight tensor's *mean* KL; the ELBO needs the KL summed "
                   "over all weights (then / N_train per example). At MOPED initialisation (seed "
                   f"{0}): Σ KL = {kl[0]['kl_sum']:.4g} over {kl[0]['weights']:.0f} weights vs "
                   f"get_kl_loss = {kl[0]['kl_get_kl_loss']:.4g} (ratio {kl[0]['ratio']:.4g}); "
                   "the benchmark trains with Σ KL / N_train.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # re-render the Markdown from a results JSON
    import json
    import sys
    from pathlib import Path

    path = Path(sys.argv[1])
    path.with_suffix(".md").write_text(write_markdown(json.loads(path.read_text())))


def _best(rows: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key, _, higher in MAIN_COLUMNS:
        valid = {n: r["metrics"][key]["value"] for n, r in rows.items() if key in r["metrics"]}
        if valid:
            out[key] = (max if higher else min)(valid, key=valid.get)
    return out
