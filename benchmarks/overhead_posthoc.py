"""Overhead of post-hoc posteriors (issue 5): last-layer Laplace fit and probit prediction
against one eval forward of the same batch.

timm resnet18 (random init, pretrained=False), batch 32 of 3×64×64, median of ``--reps``
repetitions after warm-up. Ratios are measured in the same run::

    python benchmarks/overhead_posthoc.py [--reps 20] [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch


def interleaved_medians(fns: dict[str, Callable[[], None]], reps: int, *, warmup: int = 3,
                        sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds of every function, timed in turn within each repetition so that
    load changes on a shared machine hit all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import timm

    from bayesify import bayesify

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False).to(device).eval()
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    rows = []
    for structure in ("kron", "diag"):
        bnn = bayesify(copy.deepcopy(model), "laplace", structure=structure, prior_method="fixed").eval()
        method = bnn.method
        batch = [(x, y)]
        method.fit(bnn, batch, device=device, progress=False)  # posterior ready (eigh once)
        pred = bnn.predictor()
        t = interleaved_medians({
            "forward": forward,
            "fit": lambda m=method, b=bnn, d=batch: m.accumulate_curvature(b, d, device=device),
            "predict": lambda p=pred: p.member_logits(x),
        }, args.reps, sync=sync)
        rows.append((structure, t["forward"], t["fit"], t["predict"]))
    print(f"device={device}, threads={args.threads}, resnet18, batch {args.batch}×3×{args.size}×{args.size}, "
          f"median of {args.reps}")
    print("| structure | eval forward (ms) | fit per batch (ms) | fit / forward | probit predict (ms) "
          "| predict / forward |")
    print("|---|---|---|---|---|---|")
    for structure, t_forward, t_fit, t_pred in rows:
        print(f"| {structure} | {t_forward * 1e3:.2f} | {t_fit * 1e3:.2f} | {t_fit / t_forward:.3f} | "
              f"{t_pred * 1e3:.2f} | {t_pred / t_forward:.3f} |")


if __name__ == "__main__":
    main()
