"""Fine-tune a Bayesian posterior on a pretrained ImageNet classifier (data parallel).

    torchrun --nproc_per_node=8 examples/finetune_imagenet.py \
        --model torchvision:resnet50 --pretrained --weights IMAGENET1K_V1 \
        --data /data/imagenet --method ibnn --components 4 --out runs/r50-ibnn-k4

``--method NAME --help`` lists the options of that posterior family. Every
argument (family options, model name, checkpoint and its classifier head, the
ImageFolder layout, world size × batch size vs data size, output directory) is
checked before any training starts and before anything is written. Single
process works too (``python examples/finetune_imagenet.py ...``). ``--batch-size``
is per process: the global batch is batch size × number of processes.

Outputs in ``--out`` (the layout of ``bayesify fit --out``, so ``bayesify calibrate /
evaluate / export --posterior OUT`` read it): ``posterior.safetensors`` +
``bayesify.json`` (the final posterior, staged in ``posterior.incomplete/`` and moved
in when complete), ``run.json`` (model, data, classes; paths relative to OUT),
``history.jsonl`` (one line per epoch, with val accuracy/NLL/ECE),
``final_metrics.json``, ``args.json`` and ``checkpoints/`` (resumable; rerunning the
same command continues from the newest one). See examples/README_imagenet.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from bayesify import bayesify, fit
from bayesify.cli import exit_if_worse, fit_outcome
from bayesify.core.registry import list_methods
from bayesify.data.model_source import create_model, model_transforms
from bayesify.data.sources import default_workers, inspect_image_folder, plan_batches
from bayesify.errors import BayesifyError
from bayesify.train import cleanup_distributed, evaluate_sharded, setup_distributed
from bayesify.train.checkpoint import list_checkpoints
from bayesify.train.distributed import broadcast_object
from bayesify.train.imagenet import (
    RUN_PATHS,
    add_family_options,
    check_family_options,
    check_resume_batch,
    families_epilog,
    family_help_only,
    family_options,
    image_folder_loaders,
    install_files,
    peek_method,
    portable_path,
    save_posterior_files,
)
from bayesify.train.loop import EPOCHS_HELP
from bayesify.train.schedules import SCHEDULE_HELP, parse_schedule

PROG = "finetune_imagenet.py"


def build_parser(method: str = "ibnn", *, show_family: bool = True) -> argparse.ArgumentParser:
    """Common flags plus the options of ``method`` (shown in ``--help`` when ``show_family``)."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,  # `--component 4` must not silently mean --components
        prog=PROG,
        usage=f"{PROG} --model SOURCE:NAME --data DIR --out DIR [--method NAME] [options]",
        description="Bayesify a pretrained ImageNet model and fine-tune its posterior "
                    "(launch with torchrun for data parallelism).",
        epilog=families_epilog(PROG) + " The final evaluation uses the family's prediction "
               "setting (iBNN: --predict-samples n per component, M = K·n members).",
    )
    p.add_argument("--version", action="version", version=f"bayesify {bayesify.__version__}")
    m = p.add_argument_group("model and data")
    m.add_argument("--model", required=True,
                   help="SOURCE:NAME, e.g. timm:resnet50 or torchvision:resnet50")
    m.add_argument("--pretrained", action="store_true",
                   help="load the hub's pretrained weights (needs network access)")
    m.add_argument("--weights", default=None,
                   help="torchvision weights tag with --pretrained, e.g. IMAGENET1K_V1 "
                        "(default: the model's DEFAULT weights)")
    m.add_argument("--checkpoint", default=None,
                   help="local weights file (.safetensors or torch.save state dict) instead of "
                        "--pretrained; its classifier head must match the class count")
    m.add_argument("--num-classes", type=int, default=None,
                   help="classifier size (default: the number of class folders in DATA/train)")
    m.add_argument("--data", required=True,
                   help="directory with train/ and val/ ImageFolder sub-directories")
    m.add_argument("--image-size", type=int, default=None,
                   help="crop size override (default: the model's own preprocessing config)")
    m.add_argument("--workers", type=int, default=None,
                   help="data-loading workers per process (default: from the CPUs available "
                        "to each process: CPUs/processes - 1, at most 8; 0 below 3 CPUs)")
    m.add_argument("--batch-size", type=int, default=32,
                   help="training batch PER PROCESS; global batch = this × number of "
                        "processes (8 GPUs × 32 = 256) (default: 32)")
    m.add_argument("--eval-batch-size", type=int, default=None,
                   help="validation batch per process (default: --batch-size)")
    m.add_argument("--method", default="ibnn", choices=list_methods(),
                   help="posterior family (default: ibnn); `--method NAME --help` lists its "
                        "options")

    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=None, help=EPOCHS_HELP)
    t.add_argument("--lr", type=float, default=None,
                   help="learning rate of the posterior group (default: the family's)")
    t.add_argument("--lr-schedule", default="constant",
                   help=f"posterior LR schedule: {SCHEDULE_HELP} (default: constant)")
    t.add_argument("--base-lr", type=float, default=0.0,
                   help="learning rate of the pretrained weights (default: 0 = frozen)")
    t.add_argument("--base-lr-schedule", default="constant",
                   help="schedule of the base LR, same syntax as --lr-schedule (default: constant)")
    t.add_argument("--beta", type=float, default=1.0, help="final weight β of the KL term "
                   "(default: 1)")
    t.add_argument("--kl-anneal-epochs", type=float, default=0.0,
                   help="β rises linearly from 0 over this many epochs (default: 0 = fixed β)")
    t.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"),
                   help="optimiser (default: sgd with Nesterov momentum)")
    t.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    t.add_argument("--weight-decay", type=float, default=0.0,
                   help="weight decay of the posterior group (default: 0)")
    t.add_argument("--base-weight-decay", type=float, default=0.0,
                   help="weight decay of the base group (default: 0)")
    t.add_argument("--train-bn", action="store_true",
                   help="update BatchNorm statistics while fine-tuning (default: frozen); "
                        "then a partial last global batch is dropped, and reported")
    t.add_argument("--grad-accum-steps", type=int, default=1,
                   help="micro-batches per optimiser step (default: 1)")
    t.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip the global gradient norm to this value (default: no clipping)")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the posterior init, data order and noise streams (default: 0)")

    s = p.add_argument_group("speed")
    s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu; under torchrun cuda becomes cuda:LOCAL_RANK "
                        "(default: cuda when available)")
    s.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: on for CUDA)")
    s.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="channels_last memory format (default: on for CUDA)")
    s.add_argument("--compile", action="store_true", help="torch.compile the training forward")

    e = p.add_argument_group("evaluation, output and resume")
    e.add_argument("--val-every", type=int, default=1,
                   help="validate every N epochs; the last epoch always (default: 1)")
    e.add_argument("--val-samples", type=int, default=None,
                   help="noise samples per component in per-epoch validation (default: the "
                        "family's; then the last epoch's validation is the final evaluation)")
    e.add_argument("--out", required=True,
                   help="run directory (the layout of `bayesify fit --out`): posterior."
                        "safetensors, bayesify.json, run.json, history.jsonl, "
                        "final_metrics.json, args.json, checkpoints/")
    e.add_argument("--checkpoint-every-steps", type=int, default=0,
                   help="also checkpoint every N optimiser steps (default: 0 = once per epoch)")
    e.add_argument("--keep-checkpoints", type=int, default=2,
                   help="newest checkpoints kept in OUT/checkpoints (default: 2; 0 = all)")
    e.add_argument("--resume", default="auto",
                   help="'auto' (continue from OUT/checkpoints if it holds one), 'none', or a "
                        "checkpoint file/directory (default: auto)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_family_options(p, method, show=show_family)
    if show_family:
        family_help_only(p, PROG)
    return p


def _writable(path: Path) -> bool:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK)


def preflight(args: argparse.Namespace) -> dict[str, Any]:
    """Check every argument and build the base model; nothing is written, nothing trains."""
    for flag, value, low in (("--epochs", args.epochs, 1), ("--grad-accum-steps",
                             args.grad_accum_steps, 1), ("--val-every", args.val_every, 1),
                             ("--workers", args.workers, 0), ("--keep-checkpoints",
                             args.keep_checkpoints, 0)):
        if value is not None and value < low:
            raise BayesifyError(f"{flag} must be >= {low}, got {value}")
    options = family_options(args, args.method)
    check_family_options(args.method, options)
    parse_schedule(args.lr_schedule)
    parse_schedule(args.base_lr_schedule)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise BayesifyError(f"--device {args.device} but CUDA is not available; use --device cpu")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BayesifyError(f"--out {out} exists and is not a directory")
    if not _writable(out):
        raise BayesifyError(f"--out {out} cannot be created or written to")
    if args.resume not in ("auto", "none") and not Path(args.resume).exists():
        raise BayesifyError(f"--resume {args.resume} does not exist (use 'auto' or 'none')")
    layout = inspect_image_folder(args.data)
    classes = layout.classes
    if args.num_classes is not None and args.num_classes < len(classes):
        raise BayesifyError(f"--num-classes {args.num_classes} is smaller than the "
                            f"{len(classes)} class folders in {layout.root / 'train'}")
    num_classes = args.num_classes or len(classes)
    where = ("--num-classes" if args.num_classes else
             f"--data ({len(classes)} class folders in {layout.root / 'train'})")
    model = create_model(args.model, num_classes=num_classes, pretrained=args.pretrained,
                         weights=args.weights, checkpoint=args.checkpoint, classes_from=where)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = plan_batches(layout.counts["train"], batch_size=args.batch_size, world_size=world,
                        bn_train=args.train_bn)
    if layout.counts["val"] == 0:
        raise BayesifyError(f"{layout.root / 'val'} holds no images")
    workers = default_workers() if args.workers is None else args.workers
    resume = _resume_target(args)
    if resume is not None:  # a resume that cannot continue is refused before any plan
        check_resume_batch(resume, batch_size=args.batch_size, world_size=world)
    return {"options": options, "model": model, "classes": classes, "plan": plan,
            "workers": workers, "num_classes": num_classes}


def _final_metrics(bnn: Any, history: list[dict], val_loader: Any, args: argparse.Namespace,
                   ctx: Any, amp: bool, channels_last: bool) -> dict[str, Any]:
    """The last epoch's validation when it used the prediction setting; else one evaluation."""
    last = history[-1] if history else {}
    if args.val_samples is None and "val_nll" in last and last.get("kept", "last") == "last":
        x = next(iter(val_loader))[0][:1]
        members = int(bnn.predictor().member_logits(x).shape[0])
        return {"n": len(val_loader.dataset), "members": members,
                **{k[len("val_"):]: v for k, v in last.items() if k.startswith("val_")}}
    return evaluate_sharded(bnn, val_loader, ctx, samples_per_component=None, amp=amp,
                            channels_last=channels_last)


def _write_posterior(bnn: Any, out: Path, extra: dict[str, Any], *,
                     base: Any = None) -> list[Path]:
    """The posterior, ``run.json`` (and ``base.safetensors`` of ``base``) into ``OUT``
    (staged in ``OUT/posterior.incomplete``; once complete the posterior moves in with one atomic commit, the other files one rename each)."""
    from bayesify.data.model_source import save_checkpoint

    staging = out / "posterior.incomplete"
    shutil.rmtree(staging, ignore_errors=True)
    save_posterior_files(bnn, staging, extra=extra)
    if base is not None:
        save_checkpoint(base, staging / "base.safetensors")
    return install_files(staging, out)


def _resume_target(args: argparse.Namespace) -> Any:
    """``--resume``: a checkpoint path, the newest of ``OUT/checkpoints`` (auto), or None."""
    if args.resume == "auto":
        return Path(args.out) / "checkpoints" if list_checkpoints(Path(args.out) / "checkpoints") \
            else None
    return None if args.resume == "none" else args.resume


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    method, given = peek_method(argv)
    parser = build_parser(method if method in list_methods() else "ibnn", show_family=given)
    args = parser.parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    # seeded before the model is built: without --pretrained the same command must build the
    # same network (a randomly initialised head), or resuming is refused as another base
    torch.manual_seed(args.seed)
    try:
        ready = preflight(args)
    except BayesifyError as err:
        if rank0:
            print(f"{PROG}: error: {err}\n(nothing was trained or written; see "
                  f"`{PROG} --method {args.method} --help`)", file=sys.stderr)
        raise SystemExit(2) from None

    out = Path(args.out)
    ctx = setup_distributed(args.device, torch.device(args.device))
    cuda = ctx.device.type == "cuda"
    amp = args.amp if args.amp is not None else cuda
    channels_last = args.channels_last if args.channels_last is not None else cuda
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out / "posterior.incomplete", ignore_errors=True)  # an interrupted run's
        (out / "args.json").write_text(json.dumps(vars(args), indent=2, default=str))
    train_tf, eval_tf = model_transforms(ready["model"], args.model, image_size=args.image_size,
                                         weights=args.weights)
    train_loader, val_loader, classes = image_folder_loaders(
        args.data, train_tf, eval_tf, plan=ready["plan"], workers=ready["workers"],
        eval_batch_size=args.eval_batch_size, pin_memory=cuda)

    torch.manual_seed(args.seed)  # same posterior init on every rank (DDP broadcasts anyway)
    bnn = bayesify(ready["model"], args.method, **ready["options"])
    bnn.bn_train = bool(args.train_bn)
    if ctx.is_main:
        print(bnn.summary(), flush=True)
        print(f"{len(classes)} classes (from {args.data}/train); {ready['plan'].describe()}; "
              f"{ready['workers']} loader worker(s) per process", flush=True)

    resume = broadcast_object(_resume_target(args), ctx)  # rank 0 decides: disks may differ
    training = {
        "epochs": args.epochs, "lr": args.lr, "lr_schedule": args.lr_schedule, "base_lr": args.base_lr,
        "base_lr_schedule": args.base_lr_schedule, "beta": args.beta,
        "kl_anneal_epochs": args.kl_anneal_epochs, "optimizer": args.optimizer,
        "momentum": args.momentum, "weight_decay": args.weight_decay,
        "base_weight_decay": args.base_weight_decay, "grad_accum_steps": args.grad_accum_steps,
        "clip_grad_norm": args.clip_grad_norm, "amp": amp, "channels_last": channels_last,
        "compile": args.compile, "checkpoint_every_steps": args.checkpoint_every_steps}
    # flags a family cannot honour (Laplace's one curvature pass takes no lr, momentum,
    # ...) are dropped when left at their defaults, and refused by fit when set
    for key in bnn.method.step().refused:
        flag = {"amp": "amp", "channels_last": "channels_last"}.get(key, key)
        if key in training and (getattr(args, flag, None) == parser.get_default(flag)
                                or key in ("amp", "channels_last")
                                and getattr(args, flag, None) is None):
            training.pop(key)
    try:
        result = fit(
            bnn, train_loader, **training, seed=args.seed, device=ctx.device,
            val_loader=val_loader, val_every=args.val_every,
            val_samples_per_component=args.val_samples, log_dir=out,
            checkpoint_dir=out / "checkpoints", keep_checkpoints=args.keep_checkpoints,
            resume=resume, progress=not args.no_progress and ctx.is_main,
        )
    except BayesifyError as err:  # a refused option or resume: the message, no traceback
        if ctx.is_main:
            print(f"{PROG}: error: {err}", file=sys.stderr)
        cleanup_distributed(barrier=False)  # a rank that failed alone: the others never arrive
        raise SystemExit(2) from None
    final = _final_metrics(bnn, result.history, val_loader, args, ctx, amp, channels_last)
    if ctx.is_main:
        # run.json lets `bayesify calibrate/evaluate/export --posterior OUT` rebuild the base
        # model and the data without repeating the flags (paths relative to OUT)
        run = {"model": args.model, "classes": classes, "data": portable_path(args.data, out),
               "image_size": args.image_size, "pretrained": args.pretrained,
               "checkpoint": portable_path(args.checkpoint, out), "method": args.method,
               "paths": RUN_PATHS, "outcome": fit_outcome(result.history)}
        # a randomly initialised base is kept (base.safetensors, as `bayesify fit` does)
        keep_base = ready["model"] if args.checkpoint is None and not args.pretrained else None
        written = _write_posterior(bnn, out, run, base=keep_base)
        (out / "final_metrics.json").write_text(json.dumps(final, indent=2))
        written += [out / "args.json", out / "history.jsonl", out / "final_metrics.json",
                    *list_checkpoints(out / "checkpoints")]
        print(json.dumps({"final": final}, default=float), flush=True)
        print("wrote " + ", ".join(str(p) for p in written if p.exists()), flush=True)
    cleanup_distributed()
    # a posterior worse on validation than the network it started from is not a success
    code = exit_if_worse(result.history, out, args.method)
    if code:
        raise SystemExit(code)
    return final


if __name__ == "__main__":
    main()
