"""The starting network's temperature floor with and without the unseen error, on many
networks: does the validation split's verdict ("under-confident: sharpen to T") hold on a
held-out test split of the same distribution?

For each network and seed: the validation split's floor by the paired standard error alone
(``network_floor(per_t)``, the rule before the twenty-fifth stop) and with one more error at
the split's median confidence (``network_floor(per_t, unseen_error(...))``, the rule since),
and the test split's NLL at each floor minus its NLL at T = 1 (negative: sharpening helped
on test). Sets: the CNN and ViT quality protocols (``benchmarks/protocols.py``, seeds 0–2;
networks cached with ``$BAYESIFY_BENCH_CACHE``), ``bayesify demo``'s MAP (seeds 0–3), the
stress matrix's networks (``tests/test_stress_pretrained.py::NETS``, seeds 0–2; the MiniLM
one needs its wheel).

    BAYESIFY_BENCH_CACHE=cache OMP_NUM_THREADS=1 python benchmarks/temperature_floor.py \\
        [--sets protocols demo stress] [--nets bn_cnn,two_class,...] [--json F]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from test_stress_pretrained import _logits as _loader_logits  # a model's logits on a loader

from bayesify.train.tuning import (
    TEMPERATURES,
    _nll_by_temperature,
    _runner_up_nll,
    _split,
    network_floor,
    unseen_error,
)


def case(name: str, val: tuple[torch.Tensor, torch.Tensor],
         test: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """One network: both rules' floors on ``val`` and what they cost or gain on ``test``."""
    (zv, yv), (zt, yt) = val, test
    per_t, errors = _split(_nll_by_temperature(lambda t: F.log_softmax(zv / t, -1), yv))
    test_nll = torch.stack([F.cross_entropy(zt / t, yt) for t in TEMPERATURES])
    one = TEMPERATURES.index(1.0)
    before = network_floor(per_t)
    after = network_floor(per_t, unseen_error(errors, _runner_up_nll(zv)))
    return {"case": name, "n_val": len(yv), "val_errors": int(errors.sum()),
            "n_test": len(yt), "test_errors": int((zt.argmax(-1) != yt).sum()),
            "floor_before": before, "floor_after": after,
            "test_before": float(test_nll[TEMPERATURES.index(before)] - test_nll[one]),
            "test_after": float(test_nll[TEMPERATURES.index(after)] - test_nll[one])}


def protocol_cases() -> Iterator[dict]:
    import protocols as P

    for label, make, train in (("cnn", P.protocol, P.pretrained),
                               ("vit", P.vit_protocol, P.vit_pretrained)):
        name = "digits-cnn" if label == "cnn" else "digits-vit"
        for seed in (0, 1, 2):
            p = make(seed)
            net = P.cached(train, name)(p, seed)
            with torch.no_grad():
                yield case(f"{label} seed {seed}", (net(p.val.tensors[0]), p.val.tensors[1]),
                           (net(p.test.tensors[0]), p.test.tensors[1]))


def demo_cases() -> Iterator[dict]:
    from bayesify.data.digits import digits_loaders, load_digits_splits
    from bayesify.data.models import DigitsCNN, train_map
    from bayesify.demo import run_demo

    epochs = inspect.signature(run_demo).parameters["map_epochs"].default
    for seed in (0, 1, 2, 3):
        splits = load_digits_splits(seed=seed)
        loaders = digits_loaders(splits, batch_size=64, seed=seed)
        torch.manual_seed(seed)
        net = train_map(DigitsCNN(splits.num_classes), loaders["train"], epochs=epochs,
                        seed=seed).eval()
        yield case(f"demo seed {seed}", _loader_logits(net, loaders["val"]),
                   _loader_logits(net, loaders["test"]))


def stress_cases(nets: list[str]) -> Iterator[dict]:
    import test_stress_pretrained as S

    for seed in (0, 1, 2):
        for name in nets:
            model, _, val, test = S.NETS[name](seed, True)
            yield case(f"{name} seed {seed}", _loader_logits(model, val),
                       _loader_logits(model, test))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", default=["protocols", "demo", "stress"],
                    choices=["protocols", "demo", "stress"], help="which networks")
    ap.add_argument("--nets", default=None,
                    help="stress networks, comma-separated (default: every one but minilm "
                         "when its wheel is missing)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    print("| case | val errors | test errors | floor before → after | test NLL at the floor "
          "− at T = 1, before → after |\n|---|---|---|---|---|", flush=True)
    sets = {"protocols": protocol_cases, "demo": demo_cases}
    for which in args.sets:
        if which == "stress":
            import test_stress_pretrained as S
            from pretrained_nets import minilm_path

            nets = args.nets.split(",") if args.nets else [
                n for n in S.NETS if n != "minilm" or minilm_path() is not None]
            found = stress_cases(nets)
        else:
            found = sets[which]()
        for row in found:
            rows.append(row)
            mark = " **changed**" if row["floor_before"] != row["floor_after"] else ""
            print(f"| {row['case']} | {row['val_errors']}/{row['n_val']} | "
                  f"{row['test_errors']}/{row['n_test']} | {row['floor_before']:.2f} → "
                  f"{row['floor_after']:.2f}{mark} | {row['test_before']:+.4f} → "
                  f"{row['test_after']:+.4f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
