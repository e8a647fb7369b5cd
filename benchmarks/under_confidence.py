"""How far may the families sharpen the starting network? The rule behind
:func:`bayesify.train.tuning.network_floor`, measured against the bar it is judged by.

Issues 30 and 31 check every family's clean test NLL against "start + temperature": the
starting network at the temperature that is best on the validation split (any temperature).
A family that may not sharpen below the start's floor ends near the start at its best
temperature from the floor up (the search's reference); where the start is under-confident
and the floor stays at 1, that is above the bar by what sharpening gains on test. Where the
validation split's verdict is a fluke, sharpening costs on test and under shift.

Two steps. ``--nets``: build every network × seed and keep its validation, test and
shifted-test logits (tensors) in ``--logits DIR``. ``--rules DIR``: for every kept network
× validation size (the whole split, its first 150 and 100 examples) × variant of the rule
(``k``: the gain from sharpening must exceed ``k`` paired SE, the unseen error only vetting
the split's own best temperature — the rule of the twenty-fifth stop at ``k = 3``;
``k:which``: the floor is the best temperature *with* the unseen error — the thirty-second
stop's at ``k = 1``): how many splits sharpen, ``gap`` = test NLL at the reference − test
NLL at the validation-fitted temperature (> 0.005: a miss for a family that stays at the
start) and the shift NLL at the reference ÷ at T = 1.

Networks: ``benchmarks/held_out_nets.py``'s (``NAME_ls``: trained with label smoothing 0.1,
the usual recipe of real pretrained image networks, which leaves them under-confident;
shifted by ``held_out_nets.shifted``), ``protocol:digits-cnn`` … (a quality protocol's cached
network, its own shifts pooled), ``stress:bn_cnn`` … (the stress matrix's) and ``lite0:10``
(the real ImageNet EfficientNet-Lite0 with a new head, ``benchmarks/lite0_families.py``'s
task: 90 validation images).

    BAYESIFY_BENCH_CACHE=cache OMP_NUM_THREADS=1 python benchmarks/under_confidence.py \
        --nets resnet18,resnet18_ls,protocol:digits-cnn,stress:two_class --logits kept
    python benchmarks/under_confidence.py --rules kept --variants 3,1,0,1:which
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import held_out_nets as H
from held_out_nets import shifted
from test_stress_pretrained import _logits

from bayesify.atomic_files import replace, write_temp
from bayesify.train import tuning
from bayesify.train.tuning import TEMPERATURES, _nll_by_temperature, _runner_up_nll, _split

GRID = torch.logspace(-1.5, 1.5, 121)


def nll(z, y, t):
    return float(F.cross_entropy(z / t, y))


def outputs(model, x) -> torch.Tensor:
    """``model``'s logits on ``x`` (a tensor, or a mapping of token tensors), 100 rows a call."""
    from text_protocol import input_rows, take

    with torch.no_grad():
        return torch.cat([(model(**part) if isinstance(part, dict) else model(part)).float()
                          for part in (take(x, i, i + 100)
                                       for i in range(0, input_rows(x), 100))])


def network_logits(name: str, seed: int):
    """Validation, test and shifted-test logits and labels of one network: a held-out one
    (``held_out_nets.NETS``, :func:`shifted`), or a quality protocol's (``protocol:NAME``: its cached
    pretrained network, its own shifts pooled), a stress network's (``stress:NAME``) or the
    real EfficientNet-Lite0's with a new head (``lite0:CLASSES``)."""
    if name.startswith("protocol:"):
        import protocols as P

        spec = P.PROTOCOLS[name.split(":", 1)[1]]
        p, tx, ty, by_kind, _ = spec.evaluation_sets(seed)
        model = spec.pretrained(p, seed).eval()
        vx, vy = p.val.tensors
        zs = torch.cat([outputs(model, x) for x in by_kind.values()])
        return (outputs(model, vx), vy), (outputs(model, tx), ty), zs, ty.repeat(len(by_kind))
    if name.startswith("lite0:"):  # the real ImageNet EfficientNet-Lite0, a new head
        from lite0_families import task

        model, _, _, (xt, yt), (xv, yv) = task(int(name.split(":", 1)[1]), seed)
        return ((outputs(model, xv), yv), (outputs(model, xt), yt),
                outputs(model, shifted(xt, seed)), yt)
    if name.startswith("stress:"):  # the stress matrix's network (tests/test_stress_pretrained)
        import test_stress_pretrained as S

        model, _, val, test = S.NETS[name.split(":", 1)[1]](seed, True)
    else:
        model, _, val, test = H.NETS[name](seed)
    zt, yt = _logits(model, test)
    return _logits(model, val), (zt, yt), shifted_logits(model, test, seed), yt


@torch.no_grad()
def shifted_logits(model, loader, seed: int) -> torch.Tensor:
    """``model``'s logits on ``loader``'s inputs under :func:`shifted` (tensor batches or
    dicts: every floating input, and the token ids)."""
    from bayesify.core.batch import Batch, iter_batches

    out = []
    for i, batch in enumerate(iter_batches(loader, device=torch.device("cpu"))):
        def move(name, v, i=i):
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                return v
            if v.is_floating_point() or name in (None, "input_ids"):
                return shifted(v, seed * 1000 + i)
            return v
        moved = Batch(tuple(move(None, a) for a in batch.args),
                      {k: move(k, v) for k, v in batch.kwargs.items()}, batch.labels)
        out.append(moved.call(model).float())
    return torch.cat(out)


def keep(name: str, seed: int, where: str) -> None:
    """Build one network and keep its logits in ``where`` (skipped when already there)."""
    path = Path(where) / f"{name.replace(':', '_')}_s{seed}.pt"
    if path.exists():
        return
    began = time.perf_counter()
    (zv, yv), (zt, yt), zs, ys = network_logits(name, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = write_temp(path.parent, lambda fh: torch.save([zv, yv, zt, yt, zs, ys], fh),
                        prefix=f".{path.stem}-")
    replace(staged, path)
    print(f"{name} seed {seed}: validation accuracy {float((zv.argmax(-1) == yv).float().mean()):.3f}"
          f", kept in {time.perf_counter() - began:.0f} s", flush=True)


def table(rows: list[dict], ks: list, labels: list[str] | None = None) -> str:
    """Per threshold: bar misses (test gap > 0.005 at the floor's reference), the worst gap,
    how many splits sharpen, and the shift ratio where they do (geometric mean, worst)."""
    def geo(values: list[float]) -> str:
        if not values:
            return "—"
        mean = math.exp(sum(math.log(v) for v in values) / len(values))
        return f"×{mean:.3f} (worst ×{max(values):.3f})"

    first = ks[0]
    labels = labels or [f"{k:g}" for k in ks]
    out = [("| rule | splits sharpened | test gap > 0.005 (> 0.02) | worst gap | shift NLL ÷ "
            f"at T = 1, every split | splits sharpened here and not at {labels[0]}: shift ÷ at "
            "T = 1 |"),
           "|---|---|---|---|---|---|"]
    for k, label in zip(ks, labels, strict=True):
        gaps = [r[f"gap_{k:g}"] for r in rows]
        sharp = [r for r in rows if r[f"floor_{k:g}"] < 1.0]
        new = [r[f"shift_{k:g}"] for r in sharp if r[f"floor_{first:g}"] == 1.0]
        every = geo([r[f"shift_{k:g}"] for r in rows])
        out.append(f"| {label} | {len(sharp)}/{len(rows)} | {sum(g > 0.005 for g in gaps)} "
                   f"({sum(g > 0.02 for g in gaps)}) | {max(gaps):+.4f} | {every} | "
                   f"{len(new)}: {geo(new)} |")
    return "\n".join(out)


def floor_variant(per_t: torch.Tensor, unseen: torch.Tensor | None, k: float,
                  which: str = "") -> float:
    """:func:`~bayesify.train.tuning.network_floor` with threshold ``k``. ``which``: "" — the
    split's own best temperature, which the unseen error only vets; "which" — the best
    temperature *with* the unseen error; "both" — the split's own best where it passes,
    else the best with the unseen error."""
    from bayesify.core.selection import CLEAN_TOLERANCE

    own_best = int(per_t.mean(-1).argmin())
    full = per_t if unseen is None else torch.cat([per_t, unseen.to(per_t).view(-1, 1)], 1)
    means = full.mean(-1)
    soft = min((i for i, t in enumerate(TEMPERATURES) if t >= 1.0), key=lambda i: means[i])
    if own_best == 0:
        return 1.0

    def passes(best: int) -> bool:
        if best >= soft:
            return False
        gain = full[soft] - full[best]
        se = float(gain.std() / math.sqrt(gain.numel()))
        return float(gain.mean()) > max(CLEAN_TOLERANCE, k * se)

    candidates = {"": [own_best], "which": [int(means.argmin())],
                  "both": [own_best, int(means.argmin())]}[which]
    for best in candidates:
        if passes(best):
            return min(1.0, TEMPERATURES[best])
    return 1.0


def rules(logits: str, variants: list[str]) -> str:
    """Every variant (``k`` or ``k:which``) over the kept logits: the table of :func:`table`."""
    rows = []
    for path in sorted(Path(logits).glob("*.pt")):
        zv, yv, zt, yt, zs, ys = torch.load(path, weights_only=True)
        for size in sorted({len(yv), min(150, len(yv)), min(100, len(yv))}, reverse=True):
            z, y = zv[:size], yv[:size]
            ref_t = min(GRID.tolist(), key=lambda g: nll(z, y, g))
            per_t, errors = _split(_nll_by_temperature(lambda t, z=z: F.log_softmax(z / t, -1), y))
            unseen = tuning.unseen_error(errors, _runner_up_nll(z))
            # the re-implementation is the library's rule at its own threshold
            assert floor_variant(per_t, unseen, tuning.UNDER_CONFIDENT_SE, "both") \
                == tuning.network_floor(per_t, unseen)
            row = {"case": path.stem, "n_val": size, "shift_nll_1": nll(zs, ys, 1.0)}
            ref = nll(zt, yt, ref_t)
            for i, v in enumerate(variants):
                k, _, which = v.partition(":")
                floor = floor_variant(per_t, unseen, float(k), which)
                t = min((g for g in TEMPERATURES if g >= floor - 1e-12),
                        key=lambda g, z=z, y=y: nll(z, y, g))
                row[f"floor_{i:g}"], row[f"t_{i:g}"] = floor, t
                row[f"gap_{i:g}"] = nll(zt, yt, t) - ref
                row[f"shift_{i:g}"] = nll(zs, ys, t) / row["shift_nll_1"]
            rows.append(row)
    return table(rows, list(range(len(variants))), variants)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default=None,
                    help="comma-separated networks to build (NAME, NAME_ls, protocol:NAME, "
                         "stress:NAME); their logits go to --logits")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of every network")
    ap.add_argument("--logits", default=None, help="where --nets keeps the logits")
    ap.add_argument("--rules", default=None,
                    help="a --logits directory: compare the rule's variants over it")
    ap.add_argument("--variants", default="3,2,1,0,1:which",
                    help="k (the gain must exceed k paired SE) or k:which (and the floor is "
                         "the best temperature with the unseen error)")
    args = ap.parse_args()
    if args.rules:
        print(rules(args.rules, args.variants.split(",")))
    elif args.nets and args.logits:
        for name in args.nets.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                keep(name, seed, args.logits)
    else:
        ap.error("give --nets and --logits, or --rules")


if __name__ == "__main__":
    main()
