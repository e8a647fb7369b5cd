"""Issue 31: member-wise last-layer Laplace heads and ensemble members that really differ.

On the quality protocol (``benchmarks/protocols.py``: noisy digits, a pretrained CNN, 200
fine-tuning images, 7 shifts, near + far OOD), per seed, every row ``fit(bnn, train,
val_loader=val)`` (the family knob, τ of the heads and the predictive temperature chosen
by the validation search):

* ``map`` (the start) and a 5-member deep ensemble trained from scratch (member 0 = the start);
* each family in ``--families`` at its defaults, and with ``laplace_heads=True``;
* ensemble variants (``--ensemble-variants``): re-initialised heads (``head_init='random'``)
  trained ``--epochs`` epochs (``targets='all'``, with and without online bagging
  ``bootstrap=True``, and ``targets='last_layer'``), beside the default pretrained heads +
  5 % jitter; each also with Laplace heads.

Columns: accuracy, clean NLL, mean NLL over the 7 shifts, OOD AUROC by predictive entropy,
fit seconds (ratios within one run; the machine was shared). Writes ``results/issue31.json``.

    python benchmarks/heads31.py --seeds 0 --families ensemble ibnn swag rank1 --ensemble-variants
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocols import pretrained, protocol, shifts
from quality import point_stats, predictions

import bayesify
from bayesify import metrics
from bayesify.core.prediction import temper
from bayesify.kit import laplace_heads
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
    """Every (τ, T) of the search grid on the **test** split (the oracle frontier of the
    heads: what is reachable, not a selection rule); τ is put back afterwards."""
    knob = laplace_heads.heads_knob(bnn)[0]
    chosen = bnn.state.value("heads_prior_precision")
    predictor = bnn.predictor(temperature=1.0)
    rows = []
    for tau in knob.grid:
        knob.set(float(tau))
        clean = predictions(predictor, tx).raw_log_probs
        moved = [predictions(predictor, xs).raw_log_probs for xs in shifted.values()]
        for t in TEMPERATURES:
            c = metrics.per_example_nll(temper(clean, t), ty).mean().item()
            sh = sum(metrics.per_example_nll(temper(m, t), ty).mean().item()
                     for m in moved) / len(moved)
            rows.append({"tau": float(tau), "T": float(t), "clean_nll": c, "shift_nll": sh})
    knob.set(chosen)
    return rows


def rows_for(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """``(row name, family, wrap options, fit options)``."""
    out = []
    for family in args.families:
        out.append((family, family, {}, {}))
        out.append((f"{family}+heads", family, {"laplace_heads": True}, {}))
    if args.ensemble_variants:
        for name, opts in (("ensemble random-heads", {"head_init": "random"}),
                           ("ensemble random-heads+bootstrap",
                            {"head_init": "random", "bootstrap": True}),
                           ("ensemble random-heads last_layer",
                            {"head_init": "random", "targets": "last_layer"})):
            for heads in (False, True):
                out.append((name + ("+heads" if heads else ""), "ensemble",
                            {**opts, **({"laplace_heads": True} if heads else {})},
                            {"epochs": args.epochs}))
    for name, family, options in args.variant or ():
        out.append((name, family, json.loads(options), {}))
    return out


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(seed)
    p = protocol(seed)
    tx, ty = p.test.tensors
    shifted = shifts(tx, seed)
    ood = torch.cat([p.ood_near, p.ood_far])
    t0 = time.perf_counter()
    base = pretrained(p, seed, 0, epochs=60)
    map_s = time.perf_counter() - t0
    out: dict[str, Any] = {"seed": seed, "map_seconds": map_s, "rows": {}}
    out["rows"]["map"] = score(ModelPredictor(base), tx, ty, shifted, ood)
    if args.deep_ensemble:
        t0 = time.perf_counter()
        members = [base] + [pretrained(p, seed, i, epochs=60) for i in range(1, 5)]
        row = score(ModelPredictor(members), tx, ty, shifted, ood)
        row["fit_seconds"] = map_s + time.perf_counter() - t0
        out["rows"]["deep-ensemble-x5"] = row
    for name, family, options, fit_options in rows_for(args):
        torch.manual_seed(seed)
        loaders = p.loaders(seed)
        bnn = bayesify.bayesify(copy.deepcopy(base), family, **options)
        t0 = time.perf_counter()
        result = bayesify.fit(bnn, loaders["train"], val_loader=loaders["val"], progress=False,
                              **fit_options)
        fit_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        row = score(bnn.predictor(), tx, ty, shifted, ood)
        buffers = dict(bnn.state.named_buffers())
        row.update(fit_seconds=fit_s, predict_seconds=time.perf_counter() - t0,
                   T=bnn.state.value("temperature"),
                   tau=float(buffers["heads_prior_precision"]) if "heads_prior_precision"
                   in buffers else None, val_nll=result.last.get("val_nll"),
                   heads_seconds=result.last.get("heads_seconds"))
        out["rows"][name] = row
        if args.frontier and options.get("laplace_heads"):
            row["frontier"] = frontier(bnn, tx, ty, shifted)
            start_clean = out["rows"]["map"]["clean_nll"]
            ok = [r for r in row["frontier"] if r["clean_nll"] <= start_clean + 0.005]
            best = min(ok, key=lambda r: r["shift_nll"]) if ok else None
            print(f"   oracle (test) best shift at clean <= start + 0.005: {best}", flush=True)
        print(f"seed {seed} {name:36s} acc {row['acc']:.3f} clean {row['clean_nll']:.4f} "
              f"shift {row['shift_nll']:.3f} auroc {row['auroc']:.3f} T {row['T']:.3g} "
              f"tau {row['tau']} fit {fit_s:.1f}s", flush=True)
    for name in ("map", "deep-ensemble-x5"):
        if name in out["rows"]:
            r = out["rows"][name]
            print(f"seed {seed} {name:36s} acc {r['acc']:.3f} clean {r['clean_nll']:.4f} shift "
                  f"{r['shift_nll']:.3f} auroc {r['auroc']:.3f} fit {r.get('fit_seconds', map_s):.1f}s",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--families", nargs="*", default=["ensemble", "ibnn"])
    parser.add_argument("--ensemble-variants", action="store_true")
    parser.add_argument("--deep-ensemble", action="store_true")
    parser.add_argument("--variant", nargs=3, action="append", metavar=("NAME", "FAMILY", "JSON"),
                        help="an extra row: name, family and its wrap options as JSON")
    parser.add_argument("--frontier", action="store_true",
                        help="every (τ, T) of the heads' search grid scored on the test split")
    parser.add_argument("--epochs", type=int, default=30,
                        help="epochs of the re-initialised-head ensembles")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "issue31.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs = [run_seed(seed, args) for seed in args.seeds]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
