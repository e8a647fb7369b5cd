"""Defaults vs the starting network, every family, on a pretrained digits CNN (issue 13).

Per seed: a 10-class DigitsCNN trained by ``train_map`` (6 epochs, the "pretrained"
network), then for every registered family ``bnn = bayesify(net, method=name)`` and
``fit(bnn, train, val_loader=val)`` with every option at its default. Columns (test
split): accuracy, NLL, and NLL under shift — Gaussian mixing γ = 0.4 and rotation by
45° (``bayesify.evaluation.corruptions``). Mean ± SE over seeds.

    python benchmarks/defaults.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import bayesify
from bayesify.data.digits import digits_loaders, load_digits_splits
from bayesify.data.models import DigitsCNN, train_map
from bayesify.evaluation.corruptions import corrupt

SHIFTS = {"gauss0.4": ("gaussian", 0.4), "rot45": ("rotation", 45.0)}


@torch.no_grad()
def scores(predict, loader: DataLoader) -> tuple[float, float]:
    correct, nll, n = 0, 0.0, 0
    for x, y in loader:
        log_probs = predict(x)
        correct += int((log_probs.argmax(-1) == y).sum())
        nll += float(-log_probs.gather(1, y[:, None]).sum())
        n += len(y)
    return correct / n, nll / n


def run_seed(seed: int, methods: list[str]) -> dict[str, dict[str, float]]:
    splits = load_digits_splits(seed=seed, all_classes=True)
    loaders = digits_loaders(splits, batch_size=64, seed=seed)
    torch.manual_seed(seed)
    net = train_map(DigitsCNN(splits.num_classes), loaders["train"], epochs=6, seed=seed)
    x, y = splits.test.tensors
    tests = {"clean": loaders["test"]}
    for name, (kind, level) in SHIFTS.items():
        tests[name] = DataLoader(TensorDataset(corrupt(x, kind, level, seed=seed), y), batch_size=512)

    def row(predict) -> dict[str, float]:
        out = {}
        for name, loader in tests.items():
            acc, nll = scores(predict, loader)
            if name == "clean":
                out["accuracy"] = acc
            out[f"nll_{name}"] = nll
        return out

    rows = {"start (MAP)": row(lambda b: torch.log_softmax(net(b), -1))}
    for method in methods:
        torch.manual_seed(seed)
        start = time.perf_counter()
        bnn = bayesify.bayesify(net, method=method)
        bayesify.fit(bnn, loaders["train"], val_loader=loaders["val"], progress=False, seed=seed)
        predictor = bnn.predictor()
        rows[method] = row(lambda b, p=predictor: p(b).probs.clamp_min(1e-12).log())
        rows[method]["seconds"] = time.perf_counter() - start
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="*", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    methods = args.methods or bayesify.list_methods()
    per_seed = [run_seed(s, methods) for s in args.seeds]
    cols = ["accuracy", "nll_clean", *[f"nll_{k}" for k in SHIFTS]]
    print("| row | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name in per_seed[0]:
        cells = []
        for c in cols:
            vals = torch.tensor([r[name][c] for r in per_seed], dtype=torch.float64)
            se = float(vals.std() / math.sqrt(len(vals))) if len(vals) > 1 else 0.0
            cells.append(f"{float(vals.mean()):.4f} ± {se:.4f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
