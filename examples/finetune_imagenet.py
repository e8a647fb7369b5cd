"""Fine-tune a Bayesian posterior on a pretrained ImageNet classifier (data parallel).

    torchrun --nproc_per_node=8 examples/finetune_imagenet.py \
        --model torchvision:resnet50 --pretrained --weights IMAGENET1K_V1 \
        --data /data/imagenet --method ibnn --components 4 --out runs/r50-ibnn-k4

Thin on purpose: argument parsing plus library calls (bayesify.train.imagenet for
models, preprocessing and folders; bayesify.fit for DDP training, schedules,
checkpoints; bayesify.train.evaluate_sharded for validation). Single process
works too (``python examples/finetune_imagenet.py ...``). ``--batch-size`` is per
process: the global batch is batch size × number of processes. Outputs in
``--out``: ``args.json``, ``history.jsonl`` (one line per epoch, with val
accuracy/NLL/ECE), ``checkpoints/`` (resumable; rerunning the same command
continues from the newest one), ``posterior/`` (the final posterior) and
``final_metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bayesify import bayesify, fit
from bayesify.train import cleanup_distributed, evaluate_sharded, setup_distributed
from bayesify.train.checkpoint import list_checkpoints
from bayesify.train.distributed import broadcast_object
from bayesify.train.imagenet import (
    add_method_options,
    build_transforms,
    image_folder_loaders,
    load_model,
    method_options,
    save_posterior_files,
)
from bayesify.train.schedules import SCHEDULE_HELP


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only when it is a value worth showing and not already in the help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Bayesify a pretrained ImageNet model and fine-tune its posterior "
                    "(launch with torchrun for data parallelism).",
        formatter_class=_Formatter,
        epilog="The final evaluation uses the family's prediction setting (for iBNN "
               "--predict-samples n per component, M = K·n members).",
    )
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
                        "--pretrained")
    m.add_argument("--num-classes", type=int, default=None,
                   help="classifier size (default: the architecture's, 1000 for ImageNet)")
    m.add_argument("--data", required=True,
                   help="directory with train/ and val/ ImageFolder sub-directories")
    m.add_argument("--image-size", type=int, default=None,
                   help="crop size override (default: the model's own preprocessing config)")
    m.add_argument("--workers", type=int, default=8, help="data-loading workers per process")
    m.add_argument("--batch-size", type=int, default=32,
                   help="training batch per process (global = this × number of processes)")
    m.add_argument("--eval-batch-size", type=int, default=None,
                   help="validation batch per process (default: --batch-size)")
    m.add_argument("--method", default="ibnn", help="posterior family (bayesify.list_methods())")

    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=15, help="training epochs")
    t.add_argument("--lr", type=float, default=None,
                   help="learning rate of the posterior group (default: the family's)")
    t.add_argument("--lr-schedule", default="constant",
                   help=f"posterior LR schedule: {SCHEDULE_HELP}")
    t.add_argument("--base-lr", type=float, default=0.0,
                   help="learning rate of the pretrained weights (0 keeps them frozen)")
    t.add_argument("--base-lr-schedule", default="constant",
                   help="schedule of the base LR (same syntax as --lr-schedule)")
    t.add_argument("--beta", type=float, default=1.0, help="final weight β of the KL term")
    t.add_argument("--kl-anneal-epochs", type=float, default=0.0,
                   help="β rises linearly from 0 over this many epochs (0: fixed β)")
    t.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"),
                   help="optimiser (sgd uses Nesterov momentum)")
    t.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    t.add_argument("--weight-decay", type=float, default=0.0,
                   help="weight decay of the posterior group")
    t.add_argument("--base-weight-decay", type=float, default=0.0,
                   help="weight decay of the base group")
    t.add_argument("--grad-accum-steps", type=int, default=1,
                   help="micro-batches per optimiser step")
    t.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip the global gradient norm to this value")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the posterior init, data order and noise streams")

    s = p.add_argument_group("speed")
    s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (under torchrun: cuda:LOCAL_RANK)")
    s.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: on for CUDA)")
    s.add_argument("--channels-last", action=argparse.BooleanOptionalAction,
                   default=torch.cuda.is_available(), help="channels_last memory format")
    s.add_argument("--compile", action="store_true", help="torch.compile the training forward")

    e = p.add_argument_group("evaluation, output and resume")
    e.add_argument("--val-every", type=int, default=1, help="validate every N epochs")
    e.add_argument("--val-samples", type=int, default=None,
                   help="noise samples per component in per-epoch validation "
                        "(default: the family's)")
    e.add_argument("--out", required=True,
                   help="output directory: logs, checkpoints/, posterior/, final_metrics.json")
    e.add_argument("--checkpoint-every-steps", type=int, default=0,
                   help="also checkpoint every N optimiser steps (0: once per epoch)")
    e.add_argument("--keep-checkpoints", type=int, default=2,
                   help="newest checkpoints kept in OUT/checkpoints (0: all)")
    e.add_argument("--resume", default="auto",
                   help="'auto' (continue from OUT/checkpoints if it holds one), 'none', or a "
                        "checkpoint file/directory")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_method_options(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    ctx = setup_distributed(args.device, torch.device(args.device))
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "args.json").write_text(json.dumps(vars(args), indent=2, default=str))

    model, info = load_model(args.model, pretrained=args.pretrained, checkpoint=args.checkpoint,
                             num_classes=args.num_classes, weights=args.weights)
    train_tf, eval_tf = build_transforms(model, info, image_size=args.image_size)
    train_loader, val_loader, classes = image_folder_loaders(
        args.data, train_tf, eval_tf, batch_size=args.batch_size, workers=args.workers,
        eval_batch_size=args.eval_batch_size, pin_memory=ctx.device.type == "cuda")

    torch.manual_seed(args.seed)  # same posterior init on every rank (DDP broadcasts anyway)
    bnn = bayesify(model, args.method, **method_options(args, args.method))
    if ctx.is_main:
        print(bnn.summary(), flush=True)
        print(f"{len(classes)} classes; {ctx.world_size} process(es); global batch "
              f"{args.batch_size * ctx.world_size}", flush=True)

    resume = None
    if args.resume == "auto":
        resume = out / "checkpoints" if list_checkpoints(out / "checkpoints") else None
    elif args.resume != "none":
        resume = args.resume
    resume = broadcast_object(resume, ctx)  # rank 0 decides: ranks may not share a disk
    result = fit(
        bnn, train_loader, epochs=args.epochs, lr=args.lr, lr_schedule=args.lr_schedule,
        base_lr=args.base_lr, base_lr_schedule=args.base_lr_schedule, beta=args.beta,
        kl_anneal_epochs=args.kl_anneal_epochs, optimizer=args.optimizer,
        momentum=args.momentum, weight_decay=args.weight_decay,
        base_weight_decay=args.base_weight_decay, grad_accum_steps=args.grad_accum_steps,
        clip_grad_norm=args.clip_grad_norm, seed=args.seed, device=ctx.device, amp=args.amp,
        channels_last=args.channels_last, compile=args.compile, val_loader=val_loader,
        val_every=args.val_every, val_samples_per_component=args.val_samples, log_dir=out,
        checkpoint_dir=out / "checkpoints", checkpoint_every_steps=args.checkpoint_every_steps,
        keep_checkpoints=args.keep_checkpoints, resume=resume,
        progress=not args.no_progress and ctx.is_main,
    )
    amp = args.amp if args.amp is not None else ctx.device.type == "cuda"
    final = evaluate_sharded(bnn, val_loader, ctx, samples_per_component=None,
                             amp=amp, channels_last=args.channels_last)
    if ctx.is_main:
        save_posterior_files(bnn, out / "posterior", extra={"model": args.model,
                                                            "classes": classes})
        (out / "final_metrics.json").write_text(json.dumps(final, indent=2))
        print(json.dumps({"final": final, "last_epoch": result.history[-1]}, default=float),
              flush=True)
    cleanup_distributed()
    return final


if __name__ == "__main__":
    main(sys.argv[1:])
