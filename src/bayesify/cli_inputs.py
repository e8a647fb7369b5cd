"""What every ``bayesify`` sub-command shares: flags, checks, the base model, outputs.

- :func:`add_source_arguments`: ``--data --model --checkpoint ...``, the same name
  and meaning in every command (``--method`` is always the posterior family).
- :func:`check_common` / :func:`resolve`: every argument is checked (paths, data
  layout, model name, checkpoint head vs class count, batch size × processes vs
  data size) before the optional MAP pre-training and before anything is written.
- :class:`StagedOutput`: outputs are written into ``OUT.incomplete/`` and moved
  into ``OUT`` only when the command succeeds; the summary lists every file.
- Under ``torchrun`` only rank 0 prints, shows progress bars and writes.
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

from bayesify.errors import BayesifyError

RUN_FILE = "run.json"
BASE_FILE = "base.safetensors"
CALIBRATION_FILE = "calibration.json"
STAGING_SUFFIX = ".incomplete"
#: the file that marks a staging folder as bayesify's own (only such folders are deleted)
STAGING_MARKER = ".bayesify-staging"


def is_main() -> bool:
    """Rank 0 under ``torchrun`` (or a single process): the one that prints and writes."""
    return os.environ.get("RANK", "0") == "0"


def show_progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and is_main()


# -- shared flags ------------------------------------------------------------------------
def add_source_arguments(parser: argparse.ArgumentParser, *, posterior: bool) -> None:
    """Flags shared by fit / evaluate / calibrate / export (same name, same meaning).

    For the commands that read a posterior (``posterior=True``) the base-model flags
    sit in their own group: they are read from ``--posterior``'s run.json and only
    override it (or build the MAP baseline without ``--posterior``); nothing there
    trains a posterior.
    """
    from_run = "from --posterior, else " if posterior else ""
    if posterior:
        parser.add_argument("--posterior", metavar="DIR", default=None,
                            help="run directory of `bayesify fit` (or any save_posterior "
                                 "directory); without it the plain base model (MAP) is used")
        parser.add_argument("--method", default=None,
                            help="posterior family; optional here: the family comes from "
                                 "--posterior, and a different --method is refused")
    base = parser.add_argument_group(
        "base model and data (read from --posterior's run.json; set only to override it, "
        "or for the MAP baseline without --posterior)") if posterior else parser
    base.add_argument("--data", default=None,
                      help="'digits' (embedded scikit-learn digits: classes 0-4 in "
                           "distribution, 5-9 OOD) or an ImageFolder DIR with train/ and val/ "
                           f"(and optional test/) subfolders (default: {from_run}digits)")
    base.add_argument("--model", default=None,
                      help="'digits-cnn', 'timm:NAME' (e.g. timm:resnet50) or "
                           f"'torchvision:NAME' (default: {from_run}digits-cnn); the class "
                           "count comes from --data")
    base.add_argument("--checkpoint", metavar="PATH", default=None,
                      help="base weights: a state_dict as .safetensors or a torch file (read "
                           "with weights_only=True); its classifier head must match the class "
                           "count of --data" + (" (default: RUN/base.safetensors)" if posterior
                                                 else ""))
    base.add_argument("--pretrained", action="store_true",
                      help="start from the hub weights of the timm/torchvision model "
                           "(needs network access)")
    base.add_argument("--map-epochs", type=int, default=None,
                      help=("MAP baseline only (no --posterior, --checkpoint or --pretrained): "
                            if posterior else "without --checkpoint/--pretrained, ")
                      + "train the base model on the train split for this many epochs first "
                        "(default: 40 on digits, 0 = random init on folders)")
    base.add_argument("--image-size", type=int, default=None,
                      help="input resolution (default: the model's own config; digits: 8 for "
                           "digits-cnn, 32 for timm/torchvision)")
    base.add_argument("--ood", metavar="DIR", default=None,
                      help="ImageFolder of out-of-distribution images for OOD AUROC "
                           "(digits uses classes 5-9 automatically)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help=("rows per batch; evaluation uses max(this, 256) (default: 64)"
                              if posterior else
                              "training batch per process (global = this × processes under "
                              "torchrun); evaluation uses max(this, 256) (default: 64)"))
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader worker processes (default: from the CPUs available; "
                             "0 on digits and below 3 CPUs per process)")
    parser.add_argument("--seed", type=int, default=0,
                        help=("seed of the data split and the predictive members' noise "
                              "(default: 0)" if posterior else
                              "seed of the data split, training and the predictive members' "
                              "noise (default: 0)"))
    parser.add_argument("--device", default="auto",
                        help="'cpu', 'cuda', 'cuda:1', ... or 'auto' (cuda when available)")
    parser.add_argument("--no-progress", action="store_true",
                        help="hide progress bars (under torchrun only rank 0 shows them)")
    if posterior:
        parser.add_argument("--samples", type=int, default=None,
                            help="noise samples per component at prediction (M = K x samples; "
                                 "default: the family's predict_samples)")
        parser.add_argument("--temperature", type=float, default=None,
                            help="divide member logits by this (default: RUN/calibration.json "
                                 "when present, else 1)")


_PYTHON_LITERALS: dict[str, Any] = {"True": True, "False": False, "None": None}


def key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["k=v", ...]`` → dict; values parsed as JSON when possible (``4``, ``[1,2]``);
    Python's ``True``/``False``/``None`` are read as JSON's ``true``/``false``/``null`` (a
    Python user's first try; read as the string ``'False'`` they were refused)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BayesifyError(f"{flag} expects KEY=VALUE, got {item!r}")
        if value in _PYTHON_LITERALS:
            out[key] = _PYTHON_LITERALS[value]
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BayesifyError(f"cannot read {path}: {err}") from err


def check_common(args: argparse.Namespace) -> None:
    """Checks every command shares; raises before anything is built or written."""
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--workers", args.workers, 0),
                             ("--map-epochs", args.map_epochs, 0),
                             ("--image-size", args.image_size, 1),
                             ("--samples", getattr(args, "samples", None), 1)):
        if value is not None and value < low:
            raise BayesifyError(f"{flag} must be >= {low}, got {value}")
    if getattr(args, "temperature", None) is not None and not args.temperature > 0:
        raise BayesifyError(f"--temperature must be positive, got {args.temperature}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise BayesifyError(f"--device {args.device}, but CUDA is not available; use --device cpu")
    for flag, path in (("--ood", args.ood),):
        if path is not None and not Path(path).is_dir():
            raise BayesifyError(f"{flag} {path} is not a directory")
    run_dir = getattr(args, "posterior", None)
    if run_dir is not None:
        from bayesify.persistence import read_manifest

        if not Path(run_dir).is_dir():
            raise BayesifyError(f"--posterior {run_dir} is not a directory (the --out of "
                                "`bayesify fit`)")
        family = read_manifest(run_dir).get("method")
        if args.method is not None and args.method != family:
            raise BayesifyError(f"--method {args.method} but --posterior {run_dir} holds a "
                                f"{family!r} posterior (--method is the posterior family in "
                                "every command; calibrate's method is --calibration)")
    elif getattr(args, "method", None) is not None and args.command != "fit":
        raise BayesifyError("--method names the posterior family of --posterior; without "
                            "--posterior the plain base model (MAP) is used")


def resolve(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """``(base model on device, DataBundle, spec)`` from the flags and ``RUN/run.json``.

    Everything is checked (data layout, model name, checkpoint and its head, batch
    size × processes vs data size) before the optional MAP pre-training.
    """
    from bayesify.data import sources
    from bayesify.train.imagenet import run_path

    check_common(args)
    run_dir = Path(args.posterior) if getattr(args, "posterior", None) else None
    run = read_json(run_dir / RUN_FILE) if run_dir and (run_dir / RUN_FILE).is_file() else {}
    spec = {
        "data": args.data or run_path(run, "data", run_dir) or sources.DIGITS,
        "model": args.model or run.get("model") or sources.DIGITS_CNN,
        "image_size": args.image_size or run.get("image_size"),
        "pretrained": bool(args.pretrained or run.get("pretrained", False)),
    }
    checkpoint = args.checkpoint
    if checkpoint is None and run_dir is not None and (run_dir / BASE_FILE).is_file():
        checkpoint = str(run_dir / BASE_FILE)
    elif checkpoint is None and not args.pretrained:
        checkpoint = run_path(run, "checkpoint", run_dir)  # examples/finetune_imagenet.py
    classes = sources.data_classes(spec["data"])
    channels, _ = sources.model_input(spec["model"], spec["data"], spec["image_size"])
    where = f"--data {spec['data']} ({len(classes)} classes)"
    torch.manual_seed(args.seed)
    model = sources.create_model(spec["model"], num_classes=len(classes), in_channels=channels,
                                 pretrained=spec["pretrained"], checkpoint=checkpoint,
                                 classes_from=where)
    bundle = sources.build_data(spec["data"], model, spec["model"], image_size=spec["image_size"],
                                seed=args.seed, ood=args.ood)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    spec["batches"] = sources.plan_batches(len(bundle.train), batch_size=args.batch_size,
                                           world_size=world)
    if args.workers is None:
        args.workers = 0 if spec["data"] == sources.DIGITS else sources.default_workers()
    model.to(device_of(args.device))
    map_epochs = args.map_epochs
    if map_epochs is None:
        map_epochs = 40 if spec["data"] == sources.DIGITS else 0
    if checkpoint is None and not spec["pretrained"]:
        if map_epochs > 0:
            from bayesify.data.models import train_map

            loader = bundle.loaders(batch_size=args.batch_size, seed=args.seed,
                                    workers=args.workers)["train"]
            train_map(model, OnDevice(loader, model), epochs=map_epochs, seed=args.seed,
                      progress=show_progress(args))
        elif is_main():
            print("bayesify: warning: no --checkpoint or --pretrained; the base model is "
                  "randomly initialised", file=sys.stderr)
    spec["checkpoint"] = checkpoint
    spec["classes"] = bundle.class_names
    return model.eval(), bundle, spec


class OnDevice:
    """A loader whose batches are moved to a model's device (for ``train_map``)."""

    def __init__(self, loader: Any, model: Any) -> None:
        self.loader, self.model = loader, model

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        device = next(self.model.parameters()).device
        for x, y in self.loader:
            yield x.to(device), y.to(device)


def load_predictor(args: argparse.Namespace, model: Any, *, calibration_file: bool = True) -> Any:
    """The posterior predictor of ``--posterior`` (or MAP) with its temperature: ``--temperature``,
    else ``RUN/calibration.json`` (unless ``calibration_file=False``), else the posterior's
    own (the one its fit stored)."""
    from bayesify.persistence import load_posterior
    from bayesify.predict.predictor import ModelPredictor

    if args.posterior is None:
        predictor = ModelPredictor(model)
    else:
        bnn = load_posterior(model, args.posterior)
        predictor = bnn.predictor(args.samples, seed=args.seed)
    calibration = Path(args.posterior or ".") / CALIBRATION_FILE
    if args.temperature is not None:
        predictor.temperature = float(args.temperature)
    elif calibration_file and args.posterior is not None and calibration.is_file():
        from bayesify.predict.calibration import read_calibration_file

        # checked: finite and > 0, and fitted on this posterior (a stale file is refused)
        predictor.temperature = read_calibration_file(calibration, args.posterior)
    return predictor


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def _value_text(value: Any) -> str:
    """A number to 4 places; "n/a" for None (a score without signal); a long list (e.g. a
    42-point calibration curve, kept in full in the JSON) as its length and range."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, (list, tuple)) and len(value) > 6:
        numbers = [v for v in value if isinstance(v, (int, float))]
        if len(numbers) == len(value):
            return (f"{len(value)} values, {min(numbers):.4g} … {max(numbers):.4g} "
                    "(in full in the JSON)")
        return f"{len(value)} entries (in full in the JSON)"
    return str(value)


def _flat(metrics: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested records (e.g. calibrate's ``curve``) as ``parent.key`` rows."""
    rows: list[tuple[str, Any]] = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            rows += _flat(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def format_metrics(metrics: dict[str, Any]) -> str:
    rows = [(k, _value_text(v)) for k, v in _flat(metrics)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def check_out(out: Path, flag: str = "--out") -> None:
    if out.exists() and not out.is_dir():
        raise BayesifyError(f"{flag} {out} exists and is not a directory")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not (probe.is_dir() and os.access(probe, os.W_OK)):
        raise BayesifyError(f"{flag} {out} cannot be created: {probe} is not writable")
    check_staging(out, flag)


def staging_dir(out: Path) -> Path:
    return out.parent / (out.name + STAGING_SUFFIX)


def _own_staging(folder: Path) -> bool:
    return folder.is_dir() and not folder.is_symlink() and (folder / STAGING_MARKER).is_file()


def check_staging(out: Path, flag: str = "--out") -> None:
    """``OUT.incomplete`` may be removed only when bayesify made it (it holds the marker):
    anything else there is someone's, and the command is refused before it starts."""
    folder = staging_dir(Path(out))
    if (folder.exists() or folder.is_symlink()) and not _own_staging(folder):
        raise BayesifyError(
            f"{flag} {out}: {folder} exists and was not made by bayesify (no {STAGING_MARKER} "
            "in it), so it may hold your files and is not removed; move it away or choose "
            f"another {flag}")


class StagedOutput:
    """Outputs go to ``OUT.incomplete/`` and move into ``OUT`` only when the command succeeds.

    A failed command removes its staging folder; an interrupted one leaves it, and
    the next run into the same ``OUT`` removes it first — only a folder carrying the
    ``.bayesify-staging`` marker this class writes: an ``OUT.incomplete`` of the user's
    is refused, never deleted. Ranks other than 0 stage into a private temporary folder
    that is always discarded. ``files``: what was moved into ``OUT``.
    """

    def __init__(self, out: Path) -> None:
        import tempfile

        self.out = Path(out)
        self.main = is_main()
        self.dir = (staging_dir(self.out) if self.main
                    else Path(tempfile.mkdtemp(prefix="bayesify-rank")))
        self.files: list[Path] = []

    def __enter__(self) -> Path:
        if self.main:
            check_staging(self.out)
            if self.dir.exists():  # an interrupted run's (it carries the marker)
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            (self.dir / STAGING_MARKER).write_text("made by bayesify; removed when the "
                                                   "command ends\n")
        return self.dir

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        if exc_type is None and self.main:
            from bayesify.persistence import MANIFEST_FILE, TENSOR_FILE
            from bayesify.posterior_commit import move_posterior

            if (self.dir / MANIFEST_FILE).is_file() and (self.dir / TENSOR_FILE).is_file():
                move_posterior(self.dir, self.out)  # one atomic commit, not two renames
                self.files += [self.out / TENSOR_FILE, self.out / MANIFEST_FILE]
            for src in sorted(p for p in self.dir.rglob("*")
                              if p.is_file() and p != self.dir / STAGING_MARKER):
                dst = self.out / src.relative_to(self.dir)
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
                self.files.append(dst)
        shutil.rmtree(self.dir, ignore_errors=True)
        return False

    def summary(self) -> str:
        return "wrote " + ", ".join(str(p) for p in self.files)


def progress_bar(loader: Any, desc: str, args: argparse.Namespace) -> Any:
    """``loader`` with a progress bar (rank 0 only, not with --no-progress; log lines off a
    terminal)."""
    from bayesify.progress import progress_bar as library_bar

    return library_bar(loader, desc, enabled=show_progress(args))
