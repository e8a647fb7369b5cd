"""Where a family's training step spends its GPU time, next to the plain fine-tuning step.

    python benchmarks/gpu_profile.py --model resnet50 --method ibnn [--trainable] [--compile]

Runs ``benchmarks/gpu.py``'s two steps (same rows, bf16, channels_last for CNNs) under
``torch.profiler`` and prints, for each, the operators by CUDA time, the kernel count
per step and the memory-format / dtype conversions (``aten::copy_``, ``aten::contiguous``,
``aten::to``) that are not the network's own work.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import Setup, build, step_pair

import bayesify

CONVERSIONS = ("aten::copy_", "aten::contiguous", "aten::to", "aten::_to_copy", "aten::clone")


def summarise(name: str, fn, steps: int, sync, rows: int) -> None:
    for _ in range(3):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / steps / 1e3
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\n## {name}: {rows} rows, {cuda_total:.2f} ms GPU per step, "
          f"{kernels / steps:.0f} kernels per step")
    for e in events:
        if e.key in CONVERSIONS and e.count:
            print(f"   {e.key}: {e.count / steps:.0f} calls/step, "
                  f"{e.self_device_time_total / steps / 1e3:.2f} ms GPU/step")
    print(events.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "vit_b_16"])
    parser.add_argument("--method", default="ibnn")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trainable", action="store_true", help="base at lr 1e-4 (default frozen)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    model, size, cnn = build(args.model, args.tiny)
    setup = Setup(model, batch=args.batch, size=size, cnn=cnn, device=torch.device(args.device))
    bnn = bayesify.bayesify(copy.deepcopy(setup.model), args.method).to(setup.device)
    rows, tiling, plain, step = step_pair(setup, bnn, base_lr=1e-4 if args.trainable else 0.0,
                                          compiled=args.compile)
    summarise("plain fine-tuning step", plain, args.steps, setup.sync, rows * tiling)
    summarise(f"{args.method} step", step, args.steps, setup.sync, rows * tiling)


if __name__ == "__main__":
    main()
