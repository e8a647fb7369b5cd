"""The README's "which family" table from two quality protocols' seed files.

Per family and protocol, means over the seeds of the per-seed figures of
:mod:`per_seed` (clean NLL, mean NLL over the protocol's shifts, OOD AUROC by entropy, fit and
predict seconds), as ratios within each seed: shift NLL × the start's and × the 5-member deep
ensemble's, clean NLL − MAP + temperature scaling's, AUROC − the start's, fit seconds × the
deep ensemble's training, predict seconds × the start's.

    python benchmarks/which_family.py --protocol digits-cnn results/A_seed*.pt \\
        --protocol digits-vit results/B_seed*.pt [--json F]

Files of one protocol and seed are joined as ``quality.py --merge`` joins them (the first
file's row wins).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from per_seed import seed_rows
from quality import _merge

START, SCALED, ENSEMBLE = "map", "map+ts", "deep-ensemble-x5"


def ratios(runs: dict[int, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Family → mean over seeds of the within-seed ratios and differences."""
    per: dict[str, dict[str, list[float]]] = {}
    for seed in sorted(runs):
        rows = seed_rows(runs[seed])
        start, scaled, ens = rows[START], rows[SCALED], rows[ENSEMBLE]
        for name, r in rows.items():
            if "error" in r:
                continue
            cell = per.setdefault(name, {})
            for key, value in {
                "acc_delta": r["acc"] - start["acc"],
                "clean": r["clean"], "clean_vs_ts": r["clean"] - scaled["clean"],
                "shift_x_start": r["shift"] / start["shift"],
                "shift_x_ens": r["shift"] / ens["shift"],
                "auroc": r["auroc"], "auroc_delta": r["auroc"] - start["auroc"],
                "fit_x_ens": r["fit"] / ens["fit"], "predict_x_map": r["predict"] / start["predict"],
            }.items():
                cell.setdefault(key, []).append(value)
    return {name: {k: statistics.fmean(v) for k, v in cell.items()} | {"seeds": len(cell["clean"])}
            for name, cell in per.items()}


def table(by_protocol: dict[str, dict[str, dict[str, float]]]) -> str:
    protocols = list(by_protocol)
    head = ["family"] + [f"{p}: {c}" for p in protocols for c in (
        "clean − MAP+TS", "shift × start", "shift × ens.", "AUROC (Δ start)", "fit × ens.",
        "predict × MAP")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = sorted({n for rows in by_protocol.values() for n in rows},
                   key=lambda n: (not n.startswith("bayesify:"), n))
    for name in names:
        cells = [name.removeprefix("bayesify:")]
        for p in protocols:
            r = by_protocol[p].get(name)
            if r is None:
                cells += ["—"] * 6
                continue
            cells += [f"{r['clean_vs_ts']:+.3f}", f"{r['shift_x_start']:.2f}",
                      f"{r['shift_x_ens']:.2f}", f"{r['auroc']:.3f} ({r['auroc_delta']:+.3f})",
                      f"{r['fit_x_ens']:.2f}", f"{r['predict_x_map']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", nargs="+", action="append", required=True,
                        metavar=("NAME", "FILE"), help="a protocol's name and its seed files")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    by_protocol = {name: ratios(_merge(files)) for name, *files in args.protocol}
    if args.json:
        Path(args.json).write_text(json.dumps(by_protocol, indent=1))
    print(table(by_protocol))


if __name__ == "__main__":
    main()
