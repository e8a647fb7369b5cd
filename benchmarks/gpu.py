"""GPU benchmark of the fine-tuning step and of prediction, every family vs the plain network.

torchvision ResNet-50 and ViT-B/16 at 224², bf16 autocast, channels_last for CNNs,
random data on the device. For every family and variant (base frozen / base
trainable at 1e-4; eager / ``torch.compile``):

* ``step_ratio``: the library's own training step (``bayesify.train.steps.train_step``:
  tiled forward, NLL + KL/N, backward, finite guard, optimiser step) on the same
  number of rows as one plain fine-tuning step of the network (every weight
  trainable, same optimiser), timed interleaved rep by rep, median of ``--reps``;
* ``predict_ratio``: prediction with M members (one tiled, chunked forward) over M
  eval forwards of the plain network;
* ``peak_mem_gib``: peak CUDA memory of the step; ``images_per_s``: rows / step time.

    python benchmarks/gpu.py --json benchmarks/results/gpu.json
    python benchmarks/gpu.py --device cpu --tiny --reps 3     # smoke run without a GPU

Writes the JSON (``device``, ``torch``, ``rows``) and prints a markdown table for
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import interleaved

import bayesify
from bayesify.core.batch import Batch
from bayesify.train.context import TrainState
from bayesify.train.distributed import DistContext
from bayesify.train.steps import SeededCompiledForward, TrainForward, build_optimizer, train_step

N_TRAIN = 1_281_167  # ImageNet-1k: the KL weight of a real run


def build(name: str, tiny: bool) -> tuple[torch.nn.Module, int, bool]:
    """``(model, image size, is_cnn)`` — random init (timing only)."""
    import torchvision

    if name == "resnet50":
        model = torchvision.models.resnet18() if tiny else torchvision.models.resnet50()
        return model, 32 if tiny else 224, True
    if name == "vit_b_16":
        if tiny:
            return torchvision.models.VisionTransformer(
                image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                mlp_dim=64), 32, False
        return torchvision.models.vit_b_16(), 224, False
    raise SystemExit(f"unknown model {name!r}; use resnet50 or vit_b_16")


class Setup:
    def __init__(self, model: torch.nn.Module, *, batch: int, size: int, cnn: bool,
                 device: torch.device) -> None:
        self.device, self.cnn, self.batch = device, cnn, batch
        fmt = torch.channels_last if cnn else torch.contiguous_format
        self.model = model.to(device, memory_format=fmt).eval()
        self.x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
        self.y = torch.randint(0, 1000, (batch,), device=device)
        self.amp = device.type == "cuda"
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp)

    def plain_step(self, compiled: bool) -> Any:
        """The plain fine-tuning step (every weight trainable), built and compiled once per
        variant and reused by every family's row: a compile costs a minute on a GPU."""
        cache = self.__dict__.setdefault("_plain_steps", {})
        if compiled not in cache:
            cache[compiled] = self._build_plain_step(compiled)
        return cache[compiled]

    def _build_plain_step(self, compiled: bool) -> Any:
        net = copy.deepcopy(self.model).train()
        opt = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9, nesterov=True)
        forward = torch.compile(net) if compiled else net

        def step(rows: int) -> None:
            with self.autocast():
                loss = F.cross_entropy(forward(self.x[:rows]).float(), self.y[:rows])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    def eval_forward(self) -> Any:
        net = copy.deepcopy(self.model).eval()

        @torch.no_grad()
        def forward() -> None:
            with self.autocast():
                net(self.x)
        return forward


def rows_per_example(bnn: Any, batch: int, device: Any) -> int:
    """How many training rows the family's step makes of one example (its batch layout)."""
    layout = getattr(bnn.method.step(), "layout", None)
    return 1 if layout is None else layout.components(batch, device).shape[0] // batch


def step_pair(setup: Setup, bnn: Any, *, base_lr: float,
              compiled: bool) -> tuple[int, int, Any, Any]:
    """``(examples, rows per example, plain step, library step)`` on the same number of rows."""
    tiling = rows_per_example(bnn, setup.batch, setup.device)
    rows = max(1, setup.batch // tiling)
    opt = build_optimizer(bnn, lr=1e-3, base_lr=base_lr, optimizer="sgd", momentum=0.9,
                          weight_decay=0.0, base_weight_decay=0.0)
    state = TrainState(bnn=bnn, optimizer=opt, base_lrs=[g["lr"] for g in opt.param_groups],
                       schedules=["constant"] * len(opt.param_groups), epochs=1,
                       steps_per_epoch=1000, n_train=N_TRAIN, kl_anneal_epochs=0.0,
                       beta_max=1.0, amp=setup.amp, ctx=DistContext(device=setup.device))
    state.family.begin(state)  # SWAG: snapshot period
    state.steps_per_epoch = 0
    generator = torch.Generator(device=setup.device).manual_seed(0)
    if compiled:  # as fit compiles: noise from the global RNG, seeded per step
        state.forward = SeededCompiledForward(
            torch.compile(TrainForward(bnn, None, state.family)), generator, setup.device)
    else:
        state.forward = TrainForward(bnn, generator, state.family)
    batch = Batch((setup.x[:rows],), {}, setup.y[:rows])
    plain = setup.plain_step(compiled)
    bnn.train()

    def step() -> None:
        state.step = 0
        train_step(state, batch)

    return rows, tiling, (lambda: plain(rows * tiling)), step


def family_row(setup: Setup, model_name: str, method: str, *, base_lr: float, compiled: bool,
               members: int, reps: int) -> dict[str, Any]:
    bnn = bayesify.bayesify(copy.deepcopy(setup.model), method).to(setup.device)
    row: dict[str, Any] = {"model": model_name, "method": method,
                           "variant": f"{'trainable' if base_lr else 'frozen'}-"
                                      f"{'compile' if compiled else 'eager'}"}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if bnn.method.step().optimizes:
        rows, tiling, plain, step = step_pair(setup, bnn, base_lr=base_lr, compiled=compiled)
        t_plain, t_step = interleaved([plain, step], reps, setup.sync)
        row.update(rows=rows * tiling, plain_step_s=t_plain, step_s=t_step,
                   step_ratio=t_step / t_plain, images_per_s=rows * tiling / t_step)
    else:
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(setup.x.cpu(), setup.y.cpu()), batch_size=setup.batch)
        fwd = setup.eval_forward()
        t_eval, t_fit = interleaved([fwd, lambda: bayesify.fit(bnn, loader, progress=False)],
                                    max(3, reps // 4), setup.sync, warmup=1)
        row.update(rows=setup.batch, step_s=t_fit, step_ratio=t_fit / t_eval,
                   images_per_s=setup.batch / t_fit, note="curvature pass vs eval forward")
    if torch.cuda.is_available():
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    n = max(1, members // bnn.method.components)
    predictor = bnn.predictor(samples_per_component=n)
    m = predictor.member_logits(setup.x[:2]).shape[0]
    fwd = setup.eval_forward()

    @torch.no_grad()
    def predict() -> None:
        with setup.autocast():
            predictor.member_logits(setup.x)

    t_eval, t_pred = interleaved([fwd, predict], reps, setup.sync)
    row.update(members=m, predict_s=t_pred, eval_s=t_eval, predict_ratio=t_pred / (m * t_eval))
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| model | method | variant | step × plain | predict × M·eval | peak GiB | images/s |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['variant']} | error: {r['error']} |"
                         " | | |")
            continue
        lines.append(f"| {r['model']} | {r['method']} | {r['variant']} | {r['step_ratio']:.2f} | "
                     f"{r['predict_ratio']:.2f} | {r.get('peak_mem_gib', float('nan')):.1f} | "
                     f"{r['images_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="benchmarks/results/gpu.json", help="output JSON path")
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"])
    parser.add_argument("--methods", nargs="+", default=bayesify.list_methods())
    parser.add_argument("--batch", type=int, default=128, help="rows per step (default 128)")
    parser.add_argument("--reps", type=int, default=20, help="timed reps after warm-up (>= 20)")
    parser.add_argument("--members", type=int, default=4, help="predictive members M")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--tiny", action="store_true", help="tiny models at 32 px (smoke run)")
    parser.add_argument("--variants", nargs="+", default=None,
                        choices=["frozen-eager", "trainable-eager", "frozen-compile",
                                 "trainable-compile"],
                        help="only these variants (default: all; --no-compile drops the "
                             "compiled ones)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; run with --device cpu --tiny for a smoke run")
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    rows: list[dict[str, Any]] = []
    for model_name in args.models:
        model, size, cnn = build(model_name, args.tiny)
        setup = Setup(model, batch=args.batch, size=size, cnn=cnn, device=device)
        for method in args.methods:
            for compiled in ([False] if args.no_compile else [False, True]):
                curvature = not bayesify.get_method_class(method)(
                    bayesify.get_method_class(method).config_cls()).step().optimizes
                for base_lr in ((0.0,) if curvature else (0.0, 1e-4)):
                    variant = (f"{'trainable' if base_lr else 'frozen'}-"
                               f"{'compile' if compiled else 'eager'}")
                    if args.variants and variant not in args.variants:
                        continue
                    start = time.perf_counter()
                    try:
                        row = family_row(setup, model_name, method, base_lr=base_lr,
                                         compiled=compiled, members=args.members, reps=args.reps)
                    except Exception as err:  # noqa: BLE001 - one failing row must not stop the run
                        row = {"model": model_name, "method": method,
                               "variant": f"{'trainable' if base_lr else 'frozen'}-"
                                          f"{'compile' if compiled else 'eager'}",
                               "error": f"{type(err).__name__}: {str(err)[:200]}"}
                    row["seconds"] = time.perf_counter() - start
                    rows.append(row)
                    print(json.dumps(row, default=float), flush=True)
                    write(args, device, rows)  # after every row: a run cut short keeps its rows
    write(args, device, rows)
    print(markdown(rows))


def write(args: argparse.Namespace, device: torch.device, rows: list[dict[str, Any]]) -> None:
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or platform.machine())
    out = {"device": device_name, "torch": torch.__version__, "batch": args.batch,
           "reps": args.reps, "tiny": args.tiny, "rows": rows}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=2, default=float))
    tmp.replace(path)


if __name__ == "__main__":
    main()
