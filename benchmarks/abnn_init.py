"""ABNN at initialisation (no fit): accuracy and NLL of the default predictive (K = 3
members × 4 noise draws) against the starting network, per noise std σ, on the test suite's
pretrained digits CNN (BatchNorm) and one-block MiniLM (LayerNorm).

    python benchmarks/abnn_init.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from pretrained_nets import digits_classifier, minilm_classifier

import bayesify
from bayesify.core.batch import iter_batches


def metrics(predict, loader):
    c = n = 0
    nll = 0.0
    for b in iter_batches(loader, device=torch.device("cpu")):
        lp, y = predict(b).detach(), b.labels
        c += int((lp.argmax(-1) == y).sum())
        nll += float(-lp.gather(1, y[:, None]).sum())
        n += len(y)
    return c / n, nll / n


def main() -> None:
    nets = [("digits-cnn(BN)", digits_classifier(seed=0)),
            ("minilm-1block(LN)", minilm_classifier(layers=1, seed=0, per_class=30, val_size=64))]
    for name, (model, _train, val) in nets:
        acc0, nll0 = metrics(lambda b, m=model: torch.log_softmax(b.call(m).float(), -1), val)
        print(f"{name}: start acc {acc0:.3f} nll {nll0:.3f}", flush=True)
        for s in (0.02, 0.05, 0.1, 0.2, 0.4):
            p = bayesify.bayesify(model, "abnn", noise_std=s).eval().predictor()
            acc, nll = metrics(lambda b, p=p: p(b).probs.clamp_min(1e-12).log(), val)
            print(f"  sigma {s}: acc {acc:.3f} nll {nll:.3f}", flush=True)


if __name__ == "__main__":
    main()
