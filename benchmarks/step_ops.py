"""Host-side cost of a family's training step: aten calls per step and the step ÷ plain time.

A GPU step of a wrapped network is bound by the host when it launches many small kernels
(``benchmarks/gpu.py``, RESULTS "GPU"); the number of aten calls per step is what this
machine can measure of that without a GPU. Same two steps as ``gpu.py`` (the library's
``train_step`` with the base frozen, the plain fine-tuning step), ResNet-50 on the CPU.

    python benchmarks/step_ops.py --methods ibnn rank1 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import Setup, build, step_pair

import bayesify


def aten_calls(fn) -> int:
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["ibnn", "rank1"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=32, help="image side (default 32)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _, cnn = build("resnet50", False)
    setup = Setup(model, batch=args.batch, size=args.size, cnn=cnn, device=torch.device("cpu"))
    print("| family | aten calls per step (plain) | step ms | plain ms | step ÷ plain |")
    print("|---|---|---|---|---|")
    for method in args.methods:
        bnn = bayesify.bayesify(copy.deepcopy(setup.model), method)
        _, _, plain, step = step_pair(setup, bnn, base_lr=0.0, compiled=False)
        calls, plain_calls = aten_calls(step), aten_calls(plain)
        times: list[list[float]] = [[], []]
        for rep in range(args.reps + 3):
            for fn, bucket in ((plain, times[0]), (step, times[1])):
                start = time.perf_counter()
                fn()
                if rep >= 3:
                    bucket.append(time.perf_counter() - start)
        t_plain, t_step = (statistics.median(t) for t in times)
        print(f"| {method} | {calls} ({plain_calls}) | {t_step * 1e3:.1f} | {t_plain * 1e3:.1f} | "
              f"{t_step / t_plain:.2f} |")


if __name__ == "__main__":
    main()
