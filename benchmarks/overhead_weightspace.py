"""Overhead of the weight-space families (meanfield, hypernet) against the plain model.

Part 1 (timm resnet18, random init, batch 32 of 3×64×64): ≥10 steps after
2 warm-up steps, plain and Bayesian steps interleaved (paired ratios, robust to
other load on the machine), medians of

* a training step (forward of the tiled batch + KL + backward + optimiser step),
  reported per training row (S·B rows) relative to a plain fine-tuning step per row;
* prediction (``member_logits``, M members in one chunked forward), reported per
  member relative to one plain forward of the batch.

Part 2 (torchvision resnet50, random init): parameters added by the default
hypernet (and meanfield) and the peak RSS of one training step, each measured in
a fresh subprocess (``ru_maxrss``).

    python benchmarks/overhead_weightspace.py [--steps 10] [--members 4] [--skip-memory]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

CONFIGS: dict[str, tuple[str, dict]] = {
    "meanfield (local_reparam)": ("meanfield", {}),
    "meanfield (flipout)": ("meanfield", {"sampling": "flipout"}),
    "meanfield (weights, S=1)": ("meanfield", {"sampling": "weights"}),
    "hypernet (default, S=2)": ("hypernet", {}),
    "hypernet (S=1)": ("hypernet", {"samples": 1}),
}


def _paired(fn_a, fn_b, steps: int, warmup: int = 2) -> tuple[float, float, float]:
    """Alternate ``fn_a`` / ``fn_b``; medians of each and the median of paired ratios b/a.

    Interleaving makes the ratio robust to load from other processes on a shared machine.
    """
    for _ in range(warmup):
        fn_a()
        fn_b()
    ta, tb = [], []
    for _ in range(steps):
        for fn, times in ((fn_a, ta), (fn_b, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    ratio = statistics.median(b / a for a, b in zip(ta, tb))
    return statistics.median(ta), statistics.median(tb), ratio


def timing(steps: int, members: int, batch: int = 32, size: int = 64) -> dict:
    import timm

    from bayesify import bayesify

    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).eval()
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 10, (batch,))
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    def plain_step() -> None:
        plain.train()
        loss = F.cross_entropy(plain(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    @torch.no_grad()
    def plain_predict() -> None:
        plain.eval()
        plain(x)

    out = {}
    for label, (method, options) in CONFIGS.items():
        bnn = bayesify(model, method, **options)
        bopt = torch.optim.SGD(bnn.posterior_parameters(), lr=1e-4)
        rows = batch * int(getattr(bnn.posterior_config, "samples", 1))

        def step(bnn=bnn, bopt=bopt) -> None:
            bnn.train()
            logits, targets = bnn.training_forward(x, y)
            loss = F.cross_entropy(logits, targets) + bnn.kl() / 10_000
            bopt.zero_grad(set_to_none=True)
            loss.backward()
            bopt.step()

        @torch.no_grad()
        def predict(bnn=bnn) -> None:
            bnn.eval()
            bnn.member_logits(x, samples_per_component=members, max_rows=members * batch)

        plain_train_s, train_s, train_ratio = _paired(plain_step, step, steps)
        plain_predict_s, predict_s, predict_ratio = _paired(plain_predict, predict, steps)
        out[label] = {
            "plain_train_s": plain_train_s, "train_s": train_s, "rows": rows,
            "train_per_row_ratio": train_ratio * batch / rows,
            "plain_predict_s": plain_predict_s, "predict_s": predict_s, "members": members,
            "predict_per_member_ratio": predict_ratio / members,
            "posterior_params": sum(p.numel() for p in bnn.posterior_parameters()),
        }
        print(label, json.dumps(out[label]), flush=True)
    return out


def memory_child(method: str, batch: int, size: int) -> None:
    """One training step of torchvision resnet50; prints parameter counts and peak RSS (MiB)."""
    import torchvision

    from bayesify import bayesify

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    base_params = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))
    if method == "plain":
        net, params, added = model.train(), list(model.parameters()), 0
        start = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
    else:
        bnn = bayesify(model, method, inplace=True)
        params = bnn.posterior_parameters()
        added = sum(p.numel() for p in params)
        bnn.train()
        start = time.perf_counter()
        logits, targets = bnn.training_forward(x, y)
        loss = F.cross_entropy(logits, targets) + bnn.kl() / 1_281_167
    opt = torch.optim.Adam(params, lr=1e-4)
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"method": method, "base_params": base_params, "params_added": added,
                      "peak_rss_mib": peak, "step_s": seconds}))


def memory(batch: int, size: int) -> list[dict]:
    rows = []
    for method in ("plain", "meanfield", "hypernet"):
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-child", method, "--batch", str(batch), "--size", str(size)],
            capture_output=True, text=True, check=True,
        )
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--memory-child", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.batch, args.size)
        return
    torch.set_num_threads(args.threads)
    result = {}
    if not args.skip_timing:
        result["timing"] = timing(args.steps, args.members)
    if not args.skip_memory:
        result["memory"] = memory(args.batch, args.size)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
