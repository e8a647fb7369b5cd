"""Per-seed table of a quality run from the seed files ``quality.py --save-seeds`` writes:
accuracy, clean NLL, mean NLL over the protocol's shifts, OOD AUROC (entropy; for
feature-density rows their own score), fit and predict seconds, and the ratios of the shift
NLL to the starting network's (``map``; clean NLL also against ``map+ts``) and to the 5-member deep ensemble's of the same seed.

    python benchmarks/per_seed.py results/quality_digits-vit_seed*.pt [more files] [--json F]

Files of the same seed are joined (the first file's row wins), as ``quality.py --merge``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from quality import _merge

from bayesify import metrics


def seed_rows(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for name, entry in run["rows"].items():
        if "error" in entry:
            out[name] = {"error": entry["error"]}
            continue
        test, ood = entry["test"], entry["ood"]
        shift = torch.stack([s["nll"].double().mean() for s in entry["sweeps"].values()]).mean()
        out[name] = {"acc": test["correct"].double().mean().item(),
                     "clean": test["nll"].double().mean().item(), "shift": shift.item(),
                     "auroc": metrics.auroc(test["entropy"], ood["entropy"]),
                     "fit": entry["fit_seconds"], "predict": entry["predict_seconds"],
                     "T": entry["temperature"]}
    return out


def table(runs: dict[int, dict[str, Any]]) -> str:
    lines = [("| seed | row | acc | clean NLL | Δ vs start | Δ vs MAP+TS | shift NLL | × start "
              "| × deep ens. | OOD AUROC | T | fit s | predict s |"), "|" + "---|" * 13]
    for seed in sorted(runs):
        rows = seed_rows(runs[seed])
        start, ts, ens = rows["map"], rows["map+ts"], rows.get("deep-ensemble-x5", {})
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {seed} | {name} | failed: {r['error'][:120]} |")
                continue
            vs_ens = f"{r['shift'] / ens['shift']:.2f}" if "shift" in ens else "n/a"
            lines.append(
                f"| {seed} | {name} | {r['acc']:.3f} | {r['clean']:.3f} | "
                f"{r['clean'] - start['clean']:+.3f} | {r['clean'] - ts['clean']:+.3f} | "
                f"{r['shift']:.3f} | "
                f"{r['shift'] / start['shift']:.2f} | {vs_ens} | {r['auroc']:.3f} | {r['T']:.2f} | "
                f"{r['fit']:.1f} | {r['predict']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--json", default=None, help="also write the per-seed figures here")
    args = parser.parse_args(argv)
    runs = _merge(args.files)
    if args.json:
        Path(args.json).write_text(json.dumps({seed: seed_rows(runs[seed]) for seed in sorted(runs)},
                                              indent=1))
    print(table(runs))


if __name__ == "__main__":
    main()
