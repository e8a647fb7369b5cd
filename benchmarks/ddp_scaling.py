"""Data-parallel throughput of ``bayesify.fit`` (issue 3).

CPU (always): images/s of iBNN fine-tuning with 1 and 2 processes under
``torchrun`` (gloo), per-rank batch fixed (weak scaling), resnet18 at 32×32.

GPU (when CUDA is present): ResNet-50, 224², batch 128, bf16 autocast,
channels_last — plain fine-tuning (all weights, SGD Nesterov) vs iBNN fine-tuning
of the same model through ``bayesify.fit`` (posterior + base weights at 1e-4, the
paper's ImageNet recipe; samples S=1 so both push 128 rows per step), plus iBNN
with S=2 (rows/s) and with a frozen base. Target: iBNN ≥ 0.9× plain.

    python benchmarks/ddp_scaling.py                  # CPU part (+ GPU part if CUDA)
    python benchmarks/ddp_scaling.py --gpu-only       # only the GPU part
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


# -- CPU: torchrun workers -----------------------------------------------------------------

def worker(out: str, *, batch: int, steps: int, image: int) -> None:
    """One rank: ``fit`` for 2 epochs on synthetic data; rank 0 writes epoch 2's images/s."""
    import torchvision
    from torch.utils.data import DataLoader, TensorDataset

    from bayesify import bayesify, fit
    from bayesify.train import cleanup_distributed, setup_distributed

    torch.set_num_threads(1)
    ctx = setup_distributed(None, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    n = batch * ctx.world_size * steps
    data = TensorDataset(torch.randn(n, 3, image, image, generator=g),
                         torch.randint(0, 10, (n,), generator=g))
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    bnn = bayesify(model, "ibnn", components=4)
    result = fit(bnn, DataLoader(data, batch_size=batch, shuffle=True), epochs=2, seed=0,
                 progress=False)
    if ctx.is_main:
        Path(out).write_text(json.dumps(result.history[-1]))
    cleanup_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_scaling(*, batch: int, steps: int, image: int, procs: list[int]) -> dict[int, dict]:
    results = {}
    for nproc in procs:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={_free_port()}", __file__, "--worker", str(out),
                   "--batch", str(batch), "--steps", str(steps), "--image", str(image)]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
            subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
            results[nproc] = json.loads(out.read_text())
    return results


# -- GPU: plain vs iBNN fine-tuning ---------------------------------------------------------

def _synthetic(batch: int, steps: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    return [(torch.randn(batch, 3, 224, 224, device=device, generator=g)
             .contiguous(memory_format=torch.channels_last),
             torch.randint(0, 1000, (batch,), device=device, generator=g)) for _ in range(steps)]


def plain_images_per_second(batches, *, lr: float = 1e-4) -> float:
    import torchvision

    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)

    def epoch() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for x, y in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss.item()  # the same per-step sync as fit's logging
        torch.cuda.synchronize()
        return sum(x.shape[0] for x, _ in batches) / (time.perf_counter() - start)

    epoch()  # warm-up (cuDNN autotune, allocator)
    return epoch()


def ibnn_images_per_second(batches, *, samples: int, base_lr: float) -> float:
    import torchvision

    from bayesify import bayesify, fit

    model = torchvision.models.resnet50().eval()
    bnn = bayesify(model, "ibnn", components=4, samples=samples)
    n = sum(x.shape[0] for x, _ in batches)
    result = fit(bnn, batches, epochs=2, lr=0.2, base_lr=base_lr, n_train=n, device="cuda",
                 amp=True, channels_last=True, progress=False)
    return result.history[-1]["images_per_second"]


def gpu_comparison(*, batch: int, steps: int) -> dict[str, float]:
    torch.backends.cudnn.benchmark = True
    batches = _synthetic(batch, steps, torch.device("cuda"))
    plain = plain_images_per_second(batches)
    out = {"plain": plain}
    for key, samples, base_lr in (("ibnn_s1_base1e-4", 1, 1e-4), ("ibnn_s1_frozen", 1, 0.0),
                                  ("ibnn_s2_base1e-4", 2, 1e-4)):
        out[key] = ibnn_images_per_second(batches, samples=samples, base_lr=base_lr)
        out[f"{key}_ratio"] = out[key] / plain
        out[f"{key}_rows_ratio"] = out[key] * samples / plain
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=32, help="CPU: per-rank batch")
    p.add_argument("--steps", type=int, default=8, help="CPU: steps per epoch")
    p.add_argument("--image", type=int, default=32, help="CPU: image size")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="CPU: process counts")
    p.add_argument("--gpu-only", action="store_true", help="skip the CPU part")
    p.add_argument("--gpu-batch", type=int, default=128, help="GPU: batch")
    p.add_argument("--gpu-steps", type=int, default=30, help="GPU: steps per timed epoch")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, batch=args.batch, steps=args.steps, image=args.image)
        return
    report: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not args.gpu_only:
        cpu = cpu_scaling(batch=args.batch, steps=args.steps, image=args.image, procs=args.procs)
        report["cpu"] = {n: {"images_per_second": r["images_per_second"], "nll": r["nll"]}
                         for n, r in cpu.items()}
        base = cpu[args.procs[0]]["images_per_second"]
        for n, r in cpu.items():
            print(f"CPU gloo, {n} process(es): {r['images_per_second']:.1f} images/s "
                  f"(×{r['images_per_second'] / base:.2f})")
    if torch.cuda.is_available():
        report["gpu"] = gpu_comparison(batch=args.gpu_batch, steps=args.gpu_steps)
        for k, v in report["gpu"].items():
            print(f"GPU {k}: {v:.3f}")
    else:
        print("no CUDA device: GPU part (ResNet-50 plain vs iBNN, bf16) skipped")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
