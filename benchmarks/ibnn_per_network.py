"""iBNN's default spread on a deep real network (issue 37, item 6): the predictive before any
step and after the default fit, on the ImageNet-pretrained EfficientNet-Lite0 (50 wrapped
layers) with a 3-class head on digit images (``tests/lite0_net.py``).

    OMP_NUM_THREADS=1 PYTHONPATH=.:src python benchmarks/ibnn_per_network.py --fit
    OMP_NUM_THREADS=1 PYTHONPATH=.:src python benchmarks/ibnn_per_network.py --option per_network=False

Prints one JSON line: validation accuracy / NLL of the plain network, of the default iBNN
predictive at step 0, and (``--fit``) after ``fit(bnn, train, val_loader=val)`` with every
default, with the fit's seconds and which state it kept.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--train", type=int, default=120)
    p.add_argument("--val", type=int, default=45)
    p.add_argument("--fit", action="store_true", help="run the default fit after step 0")
    p.add_argument("--epochs", type=int, default=None, help="default: fit's budget")
    p.add_argument("--option", action="append", default=[], help="ibnn option KEY=VALUE")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3],
                   help="seeds of the posterior's initialisation (step 0); the fit uses the first")
    args = p.parse_args()
    torch.set_num_threads(1)
    from lite0_net import lite0_task

    from bayesify import bayesify, fit

    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.option)}
    model, train, val = lite0_task(args.train, args.val)
    x = torch.cat([b[0] for b in val])
    y = torch.cat([b[1] for b in val])

    def metrics(probs: torch.Tensor) -> list[float]:
        nll = -torch.log(probs[torch.arange(len(y)), y].clamp_min(1e-12)).mean()
        return [round(float((probs.argmax(-1) == y).float().mean()), 3), round(float(nll), 3)]

    with torch.no_grad():
        out: dict = {"options": options, "base": metrics(torch.softmax(model(x), -1)),
                     "step0": {}}
        for seed in reversed(args.seeds):  # the first seed's posterior is the one fitted
            torch.manual_seed(seed)
            bnn = bayesify(model, method="ibnn", **options)
            out["step0"][seed] = metrics(bnn.predictor()(x).probs)
    if args.fit:
        began = time.perf_counter()
        result = fit(bnn, train, val_loader=val, progress=False, seed=0, epochs=args.epochs)
        out["fit_seconds"] = round(time.perf_counter() - began, 1)
        out["epochs"] = len(result.history)
        out["kept"] = result.last.get("kept")
        with torch.no_grad():
            out["after"] = metrics(bnn.predictor()(x).probs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
