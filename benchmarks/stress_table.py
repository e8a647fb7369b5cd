"""Tables of the stress matrix (issue 30) from its JSON lines, in-sample and held out.

``BAYESIFY_STRESS_TABLE=cells.jsonl pytest -m slow tests/test_stress_pretrained.py`` writes one
line per cell (family × trap network × with/without ``val_loader``); with
``BAYESIFY_STRESS_TEST=1`` each line also has the held-out test split's numbers (the start,
the start at the temperature best on validation, the posterior) and with
``BAYESIFY_STRESS_SEED=S`` its seed. The bar of issue 30: finite; accuracy within 1 point of the
start (2 without validation, at least one example); with validation, NLL at most the start's
at its best temperature + 0.005. In sample = on the validation split the search used (the
test's assertions: since the twenty-fifth stop against the start at its best temperature
from the floor the split vouches for, ``nll0_vouched``, where a row has it); held out = on
the test split, the temperature fitted on validation over every temperature.

    python benchmarks/stress_table.py cells_seed1.jsonl cells_seed2.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

TOLERANCE = 0.005


def load(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def misses(row: dict, *, held_out: bool) -> list[str]:
    """What of the bar ``row`` misses (empty: it meets it)."""
    p = "test_" if held_out else ""
    acc, acc0, nll = row[f"{p}acc"], row[f"{p}acc0"], row[f"{p}nll"]
    n = row.get("n_test", 400) if held_out else row["n"]
    out = []
    if not math.isfinite(nll):
        out.append("non-finite")
    slack = (0.01 if row["val"] else 0.02) + 1e-6  # float32 accuracies: 0.01 is 0.01
    if acc < acc0 - max(slack, 1.0 / n):
        out.append(f"acc {acc - acc0:+.3f}")
    reference = row["test_nll0_t"] if held_out else row.get("nll0_vouched", row["nll0_t"])
    if row["val"] and nll > reference + TOLERANCE:
        out.append(f"NLL {nll - reference:+.3f} over start + T")
    return out


def table(rows: list[dict]) -> str:
    held = all("test_nll" in r for r in rows)
    by_family: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_family[row["method"]].append(row)
    header = ("| family | cells | with val: in sample over / held out over | held out: worst NLL − "
              "(start + T + 0.005) (net, seed) | held out: worst accuracy − start with / without "
              "val | held-out misses |")
    lines = [header, "|---|---|---|---|---|---|"]
    total = defaultdict(int)
    for family in sorted(by_family):
        cells = by_family[family]
        val = [r for r in cells if r["val"]]
        ins = sum(bool(misses(r, held_out=False)) for r in val)
        out = [r for r in cells if held and misses(r, held_out=True)]
        total["cells"] += len(cells)
        total["val"] += len(val)
        total["in"] += ins
        total["out"] += len(out)
        if held and val:
            worst = max(val, key=lambda r: r["test_nll"] - r["test_nll0_t"])
            gap = worst["test_nll"] - worst["test_nll0_t"] - TOLERANCE
            nll_text = f"{gap:+.3f} ({worst['net']}, {worst.get('seed', 0)})"
        else:
            nll_text = "—"

        def worst_acc(group: list[dict]) -> str:
            if not group or not held:
                return "—"
            r = min(group, key=lambda r: r["test_acc"] - r["test_acc0"])
            return f"{r['test_acc'] - r['test_acc0']:+.3f} ({r['net']})"

        listed = "; ".join(f"{r['net']}/s{r.get('seed', 0)}/{'val' if r['val'] else 'no val'}: "
                           + ", ".join(misses(r, held_out=True)) for r in out) or "none"
        lines.append(f"| {family} | {len(cells)} | {ins}/{len(val)} / {sum(r['val'] for r in out)}"
                     f"/{len(val)} | {nll_text} | {worst_acc(val)} / "
                     f"{worst_acc([r for r in cells if not r['val']])} | {listed} |")
    lines.append(f"\n{total['cells']} cells; with validation {total['val']}: in sample "
                 f"{total['in']} over the bar, held out {total['out']} cells over (all cells).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="JSON-lines files of the stress matrix")
    print(table(load(parser.parse_args().files)))


if __name__ == "__main__":
    main()
