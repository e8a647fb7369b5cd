"""Overhead of the batch-tiled families relative to the plain network.

timm resnet18 (random init), batch B = 32 of 3×64×64, 10 classes. For each family:

* training step per row: median seconds of one optimiser step on the tiled batch
  (K·B rows for rank1 / batchensemble / ensemble, S·B for dropout) divided by the
  rows, relative to a plain fine-tuning step of the base network on B rows
  (all weights trained, SGD) per row;
* prediction per member: median seconds of ``member_logits`` (M members in one
  tiled forward) divided by M, relative to one plain forward of B rows.

Median of ``--steps`` timed steps after ``--warmup`` untimed ones. Plain and family
steps are interleaved (plain, family, plain, ...) so that both see the same machine
load; each ratio compares medians taken in the same interleaved run.

    python benchmarks/overhead_tiled.py --steps 10 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bayesify import bayesify
from bayesify.train.steps import build_optimizer

FAMILIES = {
    "rank1": {"components": 4, "init": "normal", "init_mean_std": 0.25},
    "batchensemble": {"components": 4, "init": "normal", "init_std": 0.5},
    "dropout": {"p": 0.1, "predict_samples": 4, "train_weights": True},
    "ensemble": {"components": 4},
}


def _interleaved_medians(first, second, *, steps: int, warmup: int) -> tuple[float, float]:
    """Median seconds of ``first()`` and ``second()``, timed alternately."""
    for _ in range(warmup):
        first()
        second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import timm

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).to(device).eval()
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    plain = timm.create_model("resnet18", pretrained=False, num_classes=10).to(device)
    plain.load_state_dict(model.state_dict())
    plain.train()
    for m in plain.modules():  # same frozen-BN regime as the bayesified models
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()
    opt = torch.optim.SGD(plain.parameters(), lr=1e-3, momentum=0.9)

    def plain_step() -> None:
        loss = F.cross_entropy(plain(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()

    def plain_predict() -> None:
        with torch.no_grad():
            plain.eval()
            plain(x)
            sync()

    print(f"device={device} threads={args.threads} batch={args.batch} size={args.size} "
          f"steps={args.steps} warmup={args.warmup}")
    print("| family | rows/step | plain train ms/row | train ms/row | train ratio/row | members | "
          "plain predict ms | predict ms/member | predict ratio/member |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.families.split(","):
        bnn = bayesify(model, name, **FAMILIES[name]).to(device)
        step, predict, rows, members = _family_callables(bnn, x, y, sync)
        plain_t, fam_t = _interleaved_medians(plain_step, step, steps=args.steps, warmup=args.warmup)
        plain_p, fam_p = _interleaved_medians(plain_predict, predict, steps=args.steps, warmup=args.warmup)
        train, base_train = fam_t / rows, plain_t / args.batch
        pred = fam_p / members
        print(f"| {name} | {rows} | {1e3 * base_train:.2f} | {1e3 * train:.2f} | "
              f"{train / base_train:.3f} | {members} | {1e3 * plain_p:.1f} | {1e3 * pred:.1f} | "
              f"{pred / plain_p:.3f} |", flush=True)


def _family_callables(bnn, x, y, sync):
    """(training step, prediction, rows per step, predictive members) of one family."""
    opt = build_optimizer(bnn, lr=1e-3, base_lr=0.0, optimizer="sgd", momentum=0.9,
                          weight_decay=0.0, base_weight_decay=0.0)
    rows = bnn.method.step().layout.components(x.shape[0], x.device).shape[0]

    def step() -> None:
        bnn.train()
        logits, targets = bnn.training_forward(x, y)
        loss = F.cross_entropy(logits, targets) + bnn.kl() / 50_000
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()

    predictor = bnn.predictor()
    members = predictor.member_logits(x).shape[0]

    def predict() -> None:
        predictor.member_logits(x)
        sync()

    return step, predict, rows, members

if __name__ == "__main__":
    main()
