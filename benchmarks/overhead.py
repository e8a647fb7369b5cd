"""Consolidated overhead benchmark: every bayesify family and the peers vs the plain model.

CPU section: timm resnet18 (random init), batch 32 of 3×64×64. GPU section (when
CUDA is present): ResNet-50 at 224², bf16 autocast. All ratios are measured in the
same run, with the plain and the method timing *interleaved* rep by rep (so load
drift on a shared machine hits both), median of ``--reps`` (≥ 10) after warm-up.

* gradient-trained families: one fine-tuning step (tiled training forward, NLL +
  KL/N_train, backward, SGD step) with the base frozen, on the *same number of rows*
  as the plain step (input batch 32 / tiling factor), vs one plain full fine-tuning
  step (every weight trainable, BatchNorm in train mode);
* prediction with M members (one tiled, chunked forward) vs M × one eval forward;
* post-hoc families (SWAG, Laplace): ``bayesify.fit`` on one batch vs one eval forward;
* peers: bayesian-torch (``dnn_to_bnn`` + MOPED) step and M-sample prediction,
  laplace-torch last-layer KFAC fit per batch and GLM-probit prediction.

The iBNN headline: step (K=4, S=1, base frozen) / plain full step ≤ 1.10 and
prediction with M members ≤ 1.1·M × one eval forward.

    python benchmarks/overhead.py [--reps 10] [--threads 2] [--members 4] [--skip-gpu]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayesify
from bayesify.evaluation import peers

#: options replacing the defaults for timing (what is being timed, not what tunes best)
OVERHEAD_OPTIONS: dict[str, dict[str, Any]] = {
    "ibnn": {"components": 4, "samples": 1},  # the headline configuration
    "laplace": {"prior_method": "fixed"},  # time the curvature pass, not a prior search
}
N_TRAIN = 50_000


def interleaved(fns: list[Callable[[], Any]], reps: int, sync: Callable[[], None],
                warmup: int = 2) -> list[float]:
    """Median seconds of each function, timed alternately rep by rep."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, bucket in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync()
            bucket.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


class Bench:
    """The plain model, its data and the two reference timings' callables."""

    def __init__(self, model: nn.Module, batch: int, size: int, classes: int,
                 device: torch.device, amp: bool) -> None:
        self.device, self.amp, self.batch = device, amp, batch
        self.model = model.to(device)
        self.x = torch.randn(batch, 3, size, size, device=device)
        self.y = torch.randint(0, classes, (batch,), device=device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.plain = copy.deepcopy(self.model).train()
        self.plain_opt = torch.optim.SGD(self.plain.parameters(), lr=1e-3, momentum=0.9,
                                         nesterov=True)
        self.eval_model = copy.deepcopy(self.model).eval()

    def autocast(self) -> Any:
        if self.amp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    def plain_step(self) -> None:
        with self.autocast():
            loss = F.cross_entropy(self.plain(self.x).float(), self.y)
        self.plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.plain_opt.step()

    @torch.no_grad()
    def eval_forward(self) -> None:
        with self.autocast():
            self.eval_model(self.x)

    def loader(self, batches: int = 1) -> DataLoader:
        data = TensorDataset(self.x.repeat(batches, 1, 1, 1).cpu(), self.y.repeat(batches).cpu())
        return DataLoader(data, batch_size=self.batch)


def bayesify_row(bench: Bench, name: str, members: int, reps: int) -> dict[str, Any]:
    recipe: dict[str, Any] = {}  # the library defaults: families have no recipes any more
    options = dict(OVERHEAD_OPTIONS.get(name, {}))
    bnn = bayesify.bayesify(copy.deepcopy(bench.model), name, **options).to(bench.device)
    row: dict[str, Any] = {"row": f"bayesify:{name}", "options": options}
    if bnn.method.step().optimizes:
        bnn.set_base_trainable(False)
        params = [p for p in bnn.posterior_parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, nesterov=True)
        layout = getattr(bnn.method.step(), "layout", None)
        reps_rows = (1 if layout is None
                     else layout.components(bench.batch, bench.device).shape[0] // bench.batch)
        x, y = bench.x[: max(1, bench.batch // reps_rows)], bench.y[: max(1, bench.batch // reps_rows)]

        def step() -> None:
            bnn.train()
            with bench.autocast():
                logits, targets = bnn.training_forward(x, y)
                loss = F.cross_entropy(logits.float(), targets) + bnn.kl().float() / N_TRAIN
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        t_plain, t_step = interleaved([bench.plain_step, step], reps, bench.sync)
        row.update(kind="fine-tune step (base frozen)", rows=x.shape[0] * reps_rows,
                   plain_step_s=t_plain, step_s=t_step, step_ratio=t_step / t_plain)
    else:
        fit_kwargs = {k: v for k, v in recipe.get("fit", {}).items() if k != "val_loader"}
        fit_kwargs["epochs"] = 1
        loader = bench.loader(1)
        if "val_loader" in recipe.get("fit", {}):
            fit_kwargs["val_loader"] = loader

        def fit_once() -> None:
            bayesify.fit(bnn, loader, progress=False, **fit_kwargs)

        t_eval, t_fit = interleaved([bench.eval_forward, fit_once], max(3, reps // 2), bench.sync,
                                    warmup=1)
        row.update(kind="post-hoc fit per batch", rows=bench.batch, eval_s=t_eval, fit_s=t_fit,
                   fit_ratio_vs_eval=t_fit / t_eval)
    n = max(1, members // bnn.method.components)
    predictor = bnn.predictor(samples_per_component=n)
    m = predictor.member_logits(bench.x[:2]).shape[0]

    @torch.no_grad()
    def predict() -> None:
        with bench.autocast():
            predictor.member_logits(bench.x)

    t_eval, t_pred = interleaved([bench.eval_forward, predict], reps, bench.sync)
    row.update(members=m, eval_s=t_eval, predict_s=t_pred, predict_ratio=t_pred / (m * t_eval))
    return row


def bayesian_torch_row(bench: Bench, members: int, reps: int) -> dict[str, Any]:
    model = peers.to_bayesian_torch(bench.model, moped_delta=0.1).to(bench.device)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                          momentum=0.9, nesterov=True)

    def step() -> None:
        model.train()
        with bench.autocast():
            loss = F.cross_entropy(model(bench.x).float(), bench.y)
        loss = loss + peers.bayesian_torch_kl_sum(model).to(loss.device) / N_TRAIN
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t_plain, t_step = interleaved([bench.plain_step, step], reps, bench.sync)
    predictor = peers.SampledModelPredictor(model, members)

    @torch.no_grad()
    def predict() -> None:
        with bench.autocast():
            predictor.member_logits(bench.x)

    t_eval, t_pred = interleaved([bench.eval_forward, predict], reps, bench.sync)
    return {"row": "bayesian-torch", "kind": "full mean-field step (all weights)",
            "rows": bench.batch, "plain_step_s": t_plain, "step_s": t_step,
            "step_ratio": t_step / t_plain, "members": members, "eval_s": t_eval,
            "predict_s": t_pred, "predict_ratio": t_pred / (members * t_eval)}


def laplace_torch_row(bench: Bench, reps: int) -> dict[str, Any]:
    laplace = peers._require("laplace", "laplace-torch")
    loader = bench.loader(1)
    model = copy.deepcopy(bench.model).eval()
    holder: dict[str, Any] = {}

    def fit_once() -> None:
        la = laplace.Laplace(model, "classification", subset_of_weights="last_layer",
                             hessian_structure="kron")
        la.fit(loader)
        holder["la"] = la

    t_eval, t_fit = interleaved([bench.eval_forward, fit_once], max(3, reps // 2), bench.sync,
                                warmup=1)
    predictor = peers.LaplaceTorchPredictor(holder["la"])

    def predict() -> None:
        predictor.member_logits(bench.x)

    t_eval2, t_pred = interleaved([bench.eval_forward, predict], reps, bench.sync)
    return {"row": "laplace-torch", "kind": "post-hoc fit per batch (last-layer KFAC)",
            "rows": bench.batch, "eval_s": t_eval, "fit_s": t_fit, "fit_ratio_vs_eval": t_fit / t_eval,
            "members": 1, "predict_s": t_pred, "predict_ratio": t_pred / t_eval2}


def run_section(title: str, bench: Bench, args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"== {title}", flush=True)
    rows: list[dict[str, Any]] = []
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (f"bayesify:{n}", lambda n=n: bayesify_row(bench, n, args.members, args.reps))
        for n in bayesify.list_methods() if not args.methods or n in args.methods
    ]
    if not args.methods or "bayesian-torch" in args.methods:
        jobs.append(("bayesian-torch", lambda: bayesian_torch_row(bench, args.members, args.reps)))
    if not args.methods or "laplace-torch" in args.methods:
        jobs.append(("laplace-torch", lambda: laplace_torch_row(bench, args.reps)))
    for name, job in jobs:
        torch.manual_seed(0)
        try:
            row = job()
        except Exception as err:  # noqa: BLE001 - one broken row must not stop the run
            traceback.print_exc()
            row = {"row": name, "error": f"{type(err).__name__}: {err}"}
        print("  " + _line(row), flush=True)
        rows.append(row)
    return rows


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['row']}: ERROR {row['error']}"
    train = (f"step {row['step_s'] * 1e3:.1f} ms = {row['step_ratio']:.3f}× plain full step"
             if "step_ratio" in row else
             f"fit/batch {row['fit_s'] * 1e3:.1f} ms = {row['fit_ratio_vs_eval']:.2f}× eval fwd")
    return (f"{row['row']}: {train}; predict M={row['members']} {row['predict_s'] * 1e3:.1f} ms"
            f" = {row['predict_ratio']:.3f}× (M × eval forward)")


def markdown(sections: dict[str, dict[str, Any]], command: str) -> str:
    lines = ["# Overhead relative to the plain model", "", f"Command: `{command}`", ""]
    for title, sec in sections.items():
        lines += [f"## {title}", "", f"Machine: {sec['machine']}; {sec['setup']}", "",
                  "| row | training cost | ratio | prediction (M) | ratio vs M × eval fwd |",
                  "|---|---|---|---|---|"]
        for row in sec["rows"]:
            if "error" in row:
                lines.append(f"| {row['row']} | error: {row['error'][:120]} | | | |")
                continue
            if "step_ratio" in row:
                train = (f"step {row['step_s'] * 1e3:.1f} ms vs plain full {row['plain_step_s'] * 1e3:.1f}"
                         f" ms ({row['rows']} rows, {row['kind']})")
                ratio = f"{row['step_ratio']:.3f}"
            else:
                train = (f"fit/batch {row['fit_s'] * 1e3:.1f} ms vs eval fwd {row['eval_s'] * 1e3:.1f}"
                         f" ms ({row['kind']})")
                ratio = f"{row['fit_ratio_vs_eval']:.2f} (vs eval)"
            lines.append(f"| {row['row']} | {train} | {ratio} | M={row['members']}: "
                         f"{row['predict_s'] * 1e3:.1f} ms | {row['predict_ratio']:.3f} |")
        ibnn = next((r for r in sec["rows"] if r["row"] == "bayesify:ibnn" and "error" not in r), None)
        if ibnn is not None:
            ok_step, ok_pred = ibnn["step_ratio"] <= 1.10, ibnn["predict_ratio"] <= 1.10
            lines += ["", (f"iBNN headline: step ratio {ibnn['step_ratio']:.3f} (target ≤ 1.10: "
                      f"{'met' if ok_step else 'NOT met'}); prediction {ibnn['predict_ratio']:.3f}"
                      f" × M eval forwards (target ≤ 1.1: {'met' if ok_pred else 'NOT met'}).")]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (median; ≥ 10)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--members", type=int, default=4, help="M at prediction")
    parser.add_argument("--methods", nargs="*", default=None, help="rows to run (default all)")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-gpu", action="store_true")
    parser.add_argument("--gpu-batch", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "overhead.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import timm

    command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    sections: dict[str, dict[str, Any]] = {}
    if not args.skip_cpu:
        torch.manual_seed(0)
        bench = Bench(timm.create_model("resnet18", pretrained=False, num_classes=10), 32, 64, 10,
                      torch.device("cpu"), amp=False)
        sections["CPU: resnet18, batch 32 × 3×64×64, fp32"] = {
            "machine": f"{platform.machine()} CPU, {args.threads} torch threads, torch "
                       f"{torch.__version__}, {time.strftime('%Y-%m-%d')}",
            "setup": f"median of {args.reps} interleaved reps, 10 classes",
            "rows": run_section("CPU", bench, args)}
    if torch.cuda.is_available() and not args.skip_gpu:
        torch.manual_seed(0)
        torch.backends.cudnn.benchmark = True
        bench = Bench(timm.create_model("resnet50", pretrained=False), args.gpu_batch, 224, 1000,
                      torch.device("cuda"), amp=True)
        sections[f"GPU: resnet50, batch {args.gpu_batch} × 3×224², bf16 autocast"] = {
            "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                       f"{time.strftime('%Y-%m-%d')}",
            "setup": f"median of {args.reps} interleaved reps, 1000 classes",
            "rows": run_section("GPU", bench, args)}
    text = markdown(sections, command)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
