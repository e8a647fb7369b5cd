"""Issue 29, item 3: does a Laplace posterior over more than the last layer reach a better
clean-vs-shift frontier than the last layer alone?

Per protocol and seed, the oracle frontier on the **test** split (every τ of a log grid ×
every temperature of the library's search grid, GLM predictive, probit link, the
temperature on the predictive's log-probabilities as everywhere in bayesify) of:

* ``last layer (bayesify)``: the library's default ``laplace`` posterior (the exact
  last-layer GGN up to 5,000 parameters), fitted with defaults;
* ``last block, KFAC``: laplace-torch's KFAC GGN over the last ``--block`` Linear/Conv
  layers (every other parameter fixed at the MAP), GLM predictive from per-example
  Jacobians;
* ``all layers, KFAC``: the same over every Linear/Conv layer of the network (norm layers,
  embeddings and positional parameters stay at the MAP: KFAC has no factors for them).

Reported per seed: the lowest shift NLL (mean over the protocol's shifts) with clean NLL
within 0.005 of the start's, and within 0.005 of MAP + temperature scaling's; the OOD
AUROC (predictive entropy) at that point. An oracle is what is *reachable*, not a
selection rule: if the larger posterior's frontier is not lower, no rule makes it better.

    BAYESIFY_BENCH_CACHE=cache OMP_NUM_THREADS=1 python benchmarks/laplace_block29.py \
        --protocol digits-cnn --seeds 0 1 2 --json out.json
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocols import PROTOCOLS
from quality import predictions, temperature_scale
from temperature29 import frontier, score

import bayesify
from bayesify import metrics
from bayesify.core.prediction import temper
from bayesify.predict.predictor import ModelPredictor
from bayesify.train.tuning import TEMPERATURES

TAUS = tuple(10.0 ** k for k in range(-4, 5))
BUDGET = 0.005


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)


def _kfac_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def fit_block(base: nn.Module, train: Any, last: int | None) -> Any:
    """laplace-torch KFAC over the last ``last`` Linear/Conv layers (None: all of them)."""
    from laplace import Laplace

    model = copy.deepcopy(base).eval()
    chosen = _kfac_layers(model)
    chosen = chosen if last is None else chosen[-last:]
    keep = {id(p) for m in chosen for p in m.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
    la.fit(train)
    return la, sum(p.numel() for p in model.parameters() if p.requires_grad)


def _variances(la: Any, x: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, list]:
    """MAP logits ``[n, C]`` and, per τ of :data:`TAUS`, the diagonal of the GLM's functional
    variance ``[n, C]`` (per-example Jacobians one chunk at a time, never all kept)."""
    fs, per_tau = [], [[] for _ in TAUS]
    for i in range(0, len(x), chunk):
        j, f = la.backend.jacobians(x[i:i + chunk])
        j, f = j.detach(), f.detach()
        fs.append(f)
        for k, tau in enumerate(TAUS):
            la.prior_precision = float(tau)
            with torch.no_grad():
                per_tau[k].append(la.functional_variance(j).diagonal(dim1=-2, dim2=-1))
    return torch.cat(fs), [torch.cat(v) for v in per_tau]


def block_frontier(la: Any, tx, ty, shifted, ood) -> list[dict[str, float]]:
    """Every (τ, T) on the test split: clean NLL, shift NLL, OOD AUROC (entropy)."""
    sets = {"clean": tx, "ood": ood, **{f"shift:{k}": v for k, v in shifted.items()}}
    moments = {name: _variances(la, x) for name, x in sets.items()}
    rows = []
    for k, tau in enumerate(TAUS):
        logp = {name: torch.log_softmax(f / torch.sqrt(1 + math.pi / 8 * var[k]), -1)
                for name, (f, var) in moments.items()}
        for t in TEMPERATURES:
            clean = temper(logp["clean"], t)
            shift = [metrics.per_example_nll(temper(v, t), ty).mean().item()
                     for name, v in logp.items() if name.startswith("shift:")]
            rows.append({"tau": float(tau), "T": float(t),
                         "clean_nll": metrics.per_example_nll(clean, ty).mean().item(),
                         "shift_nll": sum(shift) / len(shift),
                         "auroc": metrics.auroc(_entropy(clean), _entropy(temper(logp["ood"], t)))})
    return rows


def best_within(rows: list[dict[str, float]], limit: float) -> dict[str, float] | None:
    ok = [r for r in rows if r["clean_nll"] <= limit]
    return min(ok, key=lambda r: r["shift_nll"]) if ok else None


def _with_auroc(bnn: Any, rows: list[dict[str, float]], tx, ood) -> list[dict[str, float]]:
    """AUROC of the library's frontier rows (``frontier`` scores clean and shift only)."""
    knob = bnn.method.knobs(bnn)[0]
    chosen = float(bnn.method.prior_precision(bnn).reshape(-1)[0])
    predictor = bnn.predictor(temperature=1.0)
    cache = {}
    for tau in {r["tau"] for r in rows}:
        knob.set(tau)
        cache[tau] = (predictions(predictor, tx).raw_log_probs,
                      predictions(predictor, ood).raw_log_probs)
    knob.set(chosen)
    for r in rows:
        c, o = cache[r["tau"]]
        r["auroc"] = metrics.auroc(_entropy(temper(c, r["T"])), _entropy(temper(o, r["T"])))
    return rows


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = PROTOCOLS[args.protocol]
    p, tx, ty, shifted, ood = spec.evaluation_sets(seed)
    base = spec.pretrained(p, seed, 0, epochs=spec.map_epochs)
    loaders = p.loaders(seed)
    start = score(ModelPredictor(base), tx, ty, shifted, ood)
    ts = score(temperature_scale(base, p), tx, ty, shifted, ood)
    out: dict[str, Any] = {"seed": seed, "start": start, "map+ts": ts, "posteriors": {}}

    bnn = bayesify.bayesify(copy.deepcopy(base), "laplace")
    t0 = time.perf_counter()
    bayesify.fit(bnn, loaders["train"], val_loader=loaders["val"], progress=False)
    fit_s = time.perf_counter() - t0
    rows = _with_auroc(bnn, frontier(bnn, tx, ty, shifted), tx, ood)
    head = base.get_classifier() if hasattr(base, "get_classifier") else None
    params = sum(q.numel() for q in head.parameters()) if head is not None else None
    out["posteriors"]["last layer (bayesify)"] = {"rows": rows, "fit_seconds": fit_s,
                                                  "params": params}
    for label, last in ((f"last {args.block} layers, KFAC", args.block), ("all layers, KFAC", None)):
        t0 = time.perf_counter()
        la, n = fit_block(base, loaders["train"], last)
        fit_s = time.perf_counter() - t0
        rows = block_frontier(la, tx, ty, shifted, ood)
        out["posteriors"][label] = {"rows": rows, "fit_seconds": fit_s, "params": n}
    for label, post in out["posteriors"].items():
        for budget_name, limit in (("start", start["clean_nll"]), ("map+ts", ts["clean_nll"])):
            best = best_within(post["rows"], limit + BUDGET)
            post[f"best_vs_{budget_name}"] = best
        b = post["best_vs_start"]
        print(f"seed {seed} {label:24s} P={post['params']} fit {post['fit_seconds']:.1f}s "
              + (f"oracle@start: tau {b['tau']:.3g} T {b['T']:.3g} clean {b['clean_nll']:.4f} "
                 f"shift {b['shift_nll']:.3f} ({b['shift_nll'] / start['shift_nll']:.2f}x) "
                 f"auroc {b['auroc']:.3f}" if b else "none feasible"), flush=True)
    print(f"seed {seed} start clean {start['clean_nll']:.4f} shift {start['shift_nll']:.3f} "
          f"auroc {start['auroc']:.3f}; map+ts clean {ts['clean_nll']:.4f} shift "
          f"{ts['shift_nll']:.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", default="digits-cnn", choices=sorted(PROTOCOLS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--block", type=int, default=2,
                        help="Linear/Conv layers of the 'last block' posterior (default 2)")
    parser.add_argument("--json", type=Path, help="write every frontier row here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs = [run_seed(seed, args) for seed in args.seeds]
    if args.json:
        args.json.write_text(json.dumps({"protocol": args.protocol, "block": args.block,
                                         "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
