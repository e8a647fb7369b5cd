"""Issue 29: the temperature on the predictive, last-layer Laplace's τ × T frontier.

On the quality protocol (``benchmarks/protocols.py``: noisy digits, a pretrained CNN, 200
fine-tuning images, 7 shifts, near + far OOD), per seed:

* ``map`` (the start) and ``map+ts`` (its temperature on validation NLL);
* ``laplace`` at its defaults + ``val_loader`` (τ and T chosen by the validation search);
* ``laplace marglik``: τ by the marginal likelihood, T by the same validation search;
* the oracle frontier: every (τ, T) of the search grid scored on the **test** split
  (clean NLL, mean NLL over the 7 shifts) — what is reachable, not a selection rule;
* optionally (``--ensemble``) a 5-member deep ensemble (member 0 = the start).

Writes ``results/issue29.json`` and ``results/issue29_frontier.png`` (seed 0: every (τ, T),
the chosen point, marglik, the start, MAP+TS, the deep ensemble).

    python benchmarks/temperature29.py --seeds 0 1 2 --ensemble
    python benchmarks/temperature29.py --seeds 0 1 2 --protocol digits-vit   # protocol 2

With ``--protocol`` other than ``digits-cnn`` the files are ``issue29_<protocol>.json`` and
``issue29_<protocol>_frontier.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocols import PROTOCOLS
from quality import point_stats, predictions, temperature_scale

import bayesify
from bayesify import metrics
from bayesify.core.prediction import temper
from bayesify.predict.predictor import BasePredictor, ModelPredictor
from bayesify.train.tuning import TEMPERATURES


def score(predictor: BasePredictor, tx, ty, shifted, ood) -> dict[str, float]:
    clean = point_stats(predictions(predictor, tx), ty)
    o = point_stats(predictions(predictor, ood), None)
    shift = [point_stats(predictions(predictor, xs), ty)["nll"].mean().item()
             for xs in shifted.values()]
    return {"acc": clean["correct"].mean().item(), "clean_nll": clean["nll"].mean().item(),
            "shift_nll": sum(shift) / len(shift),
            "auroc": metrics.auroc(clean["entropy"], o["entropy"])}


@torch.no_grad()
def frontier(bnn: Any, tx, ty, shifted) -> list[dict[str, float]]:
    """Every (τ, T) of the search grid on the test split (the oracle frontier)."""
    knob = bnn.method.knobs(bnn)[0]
    chosen_tau = float(bnn.method.prior_precision(bnn).reshape(-1)[0])
    predictor = bnn.predictor(temperature=1.0)
    rows = []
    for tau in knob.grid:
        knob.set(float(tau))
        clean = predictions(predictor, tx).raw_log_probs
        moved = [predictions(predictor, xs).raw_log_probs for xs in shifted.values()]
        for t in TEMPERATURES:
            c = metrics.per_example_nll(temper(clean, t), ty).mean().item()
            s = sum(metrics.per_example_nll(temper(m, t), ty).mean().item()
                    for m in moved) / len(moved)
            rows.append({"tau": float(tau), "T": float(t), "clean_nll": c, "shift_nll": s})
    knob.set(chosen_tau)
    return rows


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = PROTOCOLS[args.protocol]
    p, tx, ty, shifted, ood = spec.evaluation_sets(seed)
    start = time.perf_counter()
    base = spec.pretrained(p, seed, 0, epochs=spec.map_epochs)
    map_s = time.perf_counter() - start
    out: dict[str, Any] = {"seed": seed, "map_seconds": map_s, "rows": {},
                           "protocol": args.protocol, "n_shifts": len(shifted)}
    out["rows"]["map"] = score(ModelPredictor(base), tx, ty, shifted, ood)
    ts = temperature_scale(base, p)
    out["rows"]["map+ts"] = {**score(ts, tx, ty, shifted, ood), "T": ts.temperature}
    for name, kwargs in (("laplace", {}), ("laplace marglik", {"prior_method": "marglik"})):
        torch.manual_seed(seed)
        loaders = p.loaders(seed)
        bnn = bayesify.bayesify(copy.deepcopy(base), "laplace", **kwargs)
        t0 = time.perf_counter()
        result = bayesify.fit(bnn, loaders["train"], val_loader=loaders["val"], progress=False)
        fit_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        row = score(bnn.predictor(), tx, ty, shifted, ood)
        row.update(fit_seconds=fit_s, predict_seconds=time.perf_counter() - t0,
                   tau=float(bnn.method.prior_precision(bnn).reshape(-1)[0]),
                   T=bnn.state.value("temperature"),
                   val_nll=result.last.get("val_nll"), val_shift_nll=result.last.get("val_shift_nll"))
        out["rows"][name] = row
        if name == "laplace":
            out["frontier"] = frontier(bnn, tx, ty, shifted)
        print(f"seed {seed} {name:16s} tau {row['tau']:.3g} T {row['T']:.3g} "
              f"clean {row['clean_nll']:.4f} shift {row['shift_nll']:.3f} "
              f"auroc {row['auroc']:.3f} fit {fit_s:.1f}s", flush=True)
    if args.ensemble:
        t0 = time.perf_counter()
        members = [base] + [spec.pretrained(p, seed, i, epochs=spec.map_epochs)
                            for i in range(1, 5)]
        row = score(ModelPredictor(members), tx, ty, shifted, ood)
        row["fit_seconds"] = map_s + time.perf_counter() - t0
        out["rows"]["deep-ensemble-x5"] = row
    for name in ("map", "map+ts", "deep-ensemble-x5"):
        if name in out["rows"]:
            r = out["rows"][name]
            print(f"seed {seed} {name:16s} clean {r['clean_nll']:.4f} shift "
                  f"{r['shift_nll']:.3f} auroc {r['auroc']:.3f}", flush=True)
    return out


def plot(run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    pts = run["frontier"]
    taus = sorted({r["tau"] for r in pts})
    sc = ax.scatter([r["clean_nll"] for r in pts], [r["shift_nll"] for r in pts], s=9,
                    c=[math.log10(r["tau"]) for r in pts], cmap="viridis", alpha=0.7)
    fig.colorbar(sc, ax=ax, label="log10 τ (every T of the grid)")
    marks = {"map": ("k", "s", "start (MAP)"), "map+ts": ("grey", "D", "MAP + TS"),
             "laplace": ("red", "*", "laplace default (search)"),
             "laplace marglik": ("orange", "P", "marglik τ + search T"),
             "deep-ensemble-x5": ("blue", "o", "deep ensemble ×5")}
    for name, (color, marker, label) in marks.items():
        r = run["rows"].get(name)
        if r:
            ax.scatter([r["clean_nll"]], [r["shift_nll"]], c=color, marker=marker, s=140,
                       edgecolors="k", label=label, zorder=5)
    ax.set_xscale("log")
    start = run["rows"]["map"]
    low = min(min(r["shift_nll"] for r in pts), *(r["shift_nll"] for r in run["rows"].values()))
    ax.set_ylim(0.9 * low, 1.3 * start["shift_nll"])
    ax.set_xlim(0.9 * min(r["clean_nll"] for r in run["rows"].values()), 1.0)
    ax.set_xlabel("clean test NLL (log scale; points beyond the axes left out)")
    ax.set_ylabel(f"mean test NLL over {run.get('n_shifts', 7)} shifts")
    ax.set_title(f"Last-layer Laplace, τ × T (predictive temperature), seed {run['seed']}; "
                 f"{len(taus)} τ × {len(TEMPERATURES)} T", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--ensemble", action="store_true", help="add a 5-member deep ensemble")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--merge", nargs="*", default=[],
                        help="issue29.json files of earlier runs to merge (no re-run of their seeds)")
    parser.add_argument("--ensemble-point", type=float, nargs=2, default=None,
                        metavar=("CLEAN", "SHIFT"), help="deep-ensemble (clean, shift) NLL of the "
                        "first seed measured elsewhere (quality.py), drawn in the plot")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="digits-cnn",
                        help="the quality protocol of benchmarks/protocols.py (default digits-cnn)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    stem = "issue29" if args.protocol == "digits-cnn" else f"issue29_{args.protocol}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [run for path in args.merge for run in json.loads(Path(path).read_text())]
    done = {run["seed"] for run in runs}
    runs += [run_seed(seed, args) for seed in args.seeds if seed not in done]
    runs.sort(key=lambda run: run["seed"])
    if args.ensemble_point and "deep-ensemble-x5" not in runs[0]["rows"]:
        clean, shift = args.ensemble_point
        runs[0]["rows"]["deep-ensemble-x5"] = {"clean_nll": clean, "shift_nll": shift,
                                               "source": "quality.py, same seed and protocol"}
    (out / f"{stem}.json").write_text(json.dumps(runs, indent=1))
    plot(runs[0], out / f"{stem}_frontier.png")


if __name__ == "__main__":
    main()
