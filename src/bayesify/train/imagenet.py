"""Pieces shared by ``examples/finetune_imagenet.py`` and ``bayesify fit``.

- Per-family command-line options: :func:`peek_method` reads ``--method`` before
  the full parser exists; :func:`add_family_options` adds one flag per config
  field of *that* family (generated from ``config_cls.describe()``: default and
  full help); :func:`family_options` turns the parsed flags into config
  keyword arguments and :func:`check_family_options` validates them before any
  work. A field named like a ``bayesify.fit`` keyword or a flag of the parser is
  named ``--<family>-<field>`` (e.g. SWAG's own SGD rate ``--swag-lr``, next to
  the trainer's ``--lr``), the same in the CLI and the script.
- :func:`image_folder_loaders`: ``DIR/train`` (shuffled) and ``DIR/val`` loaders
  for a checked :class:`~bayesify.data.sources.BatchPlan`.
- :func:`save_posterior_files`: the posterior plus a ``run.json``.

Models and preprocessing come from :mod:`bayesify.data.model_source`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bayesify.data.sources import BatchPlan, image_folder
from bayesify.errors import BayesifyError

FAMILY_DEST = "family_"


# -- one flag per config field of the chosen family --------------------------------------
def peek_method(argv: Sequence[str], *, default: str = "ibnn") -> tuple[str, bool]:
    """``(method, given)``: the value of ``--method`` in ``argv`` before full parsing."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--method", default=None)
    known, _ = pre.parse_known_args(list(argv))
    return (known.method or default), known.method is not None


def family_flag(method: str, name: str, taken: set[str] | frozenset[str]) -> str:
    """``--field-name``, or ``--<method>-field-name`` when the plain flag is already taken."""
    flag = "--" + name.replace("_", "-")
    return f"--{method}-{name.replace('_', '-')}" if flag in taken else flag


def trainer_flags() -> frozenset[str]:
    """``--name`` of every keyword of ``bayesify.fit``: a family field with such a name is
    renamed ``--<family>-<name>`` in the CLI and the script alike (e.g. ``--swag-lr``)."""
    import inspect

    from bayesify.train.loop import fit

    return frozenset("--" + name.replace("_", "-")
                     for name, p in inspect.signature(fit).parameters.items()
                     if p.kind is p.KEYWORD_ONLY)


def _value(text: str) -> Any:
    """A command-line value: JSON when it parses (numbers, true/false, null), else text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _show(default: Any) -> str:
    if isinstance(default, tuple):
        return " ".join(json.dumps(v) for v in default) or "(none)"
    return json.dumps(default, default=str)


def _metavar(name: str, default: Any) -> str:
    """What a flag's value looks like, from the field's default (``--components INT``)."""
    if name in ("targets", "feature_layers"):
        return "NAME"
    if name in ("include", "exclude"):
        return "PATTERN"
    sample = default[0] if isinstance(default, tuple) and default else default
    if isinstance(sample, bool):
        return "BOOL"
    if isinstance(sample, int):
        return "INT"
    if isinstance(sample, float):
        return "FLOAT"
    if isinstance(sample, str):
        return "TEXT"
    return "VALUE"


def add_family_options(parser: argparse.ArgumentParser, method: str, *,
                       show: bool = True) -> dict[str, str]:
    """Add one flag per config field of ``method``; returns ``{flag: field name}``.

    Flags default to "not given" (the family's default applies; the help shows
    it with the field's full help text). ``show=False`` keeps the flags parseable but
    out of ``--help`` (the generic help, where the family was not named), and adds no
    section for them.
    """
    from bayesify.core.registry import get_method_class

    cls = get_method_class(method).config_cls
    taken = frozenset(parser._option_string_actions) | trainer_flags()
    target: Any = parser
    if show:
        target = parser.add_argument_group(
            f"options of --method {method} ({cls.__name__}; unset = the default shown)",
            f"`bayesify methods {method}` prints the same list")
    flags: dict[str, str] = {}
    for name, default, help_text in cls.describe():
        flag = family_flag(method, name, taken)
        text = f"{help_text or name} (default: {_show(default)})"
        if flag != "--" + name.replace("_", "-"):
            text += f" [config field {name!r}]"
        kwargs: dict[str, Any] = {"dest": FAMILY_DEST + name, "default": argparse.SUPPRESS,
                                  # argparse formats help with %: a literal per cent stays one
                                  "help": text.replace("%", "%%") if show else argparse.SUPPRESS}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name in ("targets", "feature_layers") or isinstance(default, tuple):
            kwargs.update(nargs="+", type=_value, metavar=_metavar(name, default))
        else:
            kwargs.update(type=_value, metavar=_metavar(name, default))
        target.add_argument(flag, **kwargs)
        flags[flag] = name
    return flags


def family_options(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The config options given on the command line, typed like the family's defaults."""
    from bayesify.core.registry import get_method_class

    defaults = {name: default for name, default, _ in
                get_method_class(method).config_cls.describe()}
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith(FAMILY_DEST):
            continue
        name = dest[len(FAMILY_DEST):]
        default = defaults[name]
        if isinstance(value, list) and not isinstance(default, tuple) and len(value) == 1:
            value = value[0]
        elif isinstance(value, list):
            value = tuple(value)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        out[name] = value
    return out


def check_family_options(method: str, options: dict[str, Any]) -> Any:
    """Build the family's config from ``options`` (unknown or invalid values raise now)."""
    from bayesify.core.registry import get_method_class

    cls = get_method_class(method).config_cls
    try:
        return cls.from_kwargs(method, dict(options))
    except BayesifyError:
        raise
    except (TypeError, ValueError) as err:
        raise BayesifyError(f"invalid option for method {method!r}: {err}") from err


def family_help_only(parser: argparse.ArgumentParser, prog: str) -> None:
    """``--method NAME --help`` lists that family's options: every other flag stays parseable
    but leaves the help (``prog --help`` lists them), so the page is the family's."""
    for action in parser._actions:
        if not action.dest.startswith(FAMILY_DEST) and action.dest not in ("help", "method"):
            action.help = argparse.SUPPRESS
    parser.epilog = (f"the common flags (model, data, training, output) are listed by "
                     f"`{prog} --help`; `bayesify methods` describes every family.")


def families_epilog(prog: str) -> str:
    """The generic help's pointer to the per-family help."""
    from bayesify.core.registry import list_methods

    return (f"posterior families (--method): {', '.join(list_methods())}. Each has its own "
            f"options: `{prog} --method NAME --help` lists them with their defaults.")


# -- ImageFolder loaders -----------------------------------------------------------------
def image_folder_loaders(
    data_dir: str | Path,
    train_transform: Any,
    eval_transform: Any,
    *,
    plan: BatchPlan,
    workers: int,
    eval_batch_size: int | None = None,
    pin_memory: bool = False,
) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader, list[str]]:
    """Shuffled ``DIR/train`` and ordered ``DIR/val`` loaders, and the class names.

    ``plan.batch_size`` is per process; ``bayesify.fit`` shards the shuffled
    order over ranks under ``torchrun`` (global batch = batch_size × world size).
    ``plan.drop_last`` is set only when BatchNorm trains (see ``plan_batches``).
    """
    from torch.utils.data import DataLoader
    root = Path(data_dir)
    train = image_folder(root / "train", train_transform)  # damaged files are named
    val = image_folder(root / "val", eval_transform)
    if train.classes != val.classes:
        raise BayesifyError("train/ and val/ have different class folders")
    common = {"num_workers": workers, "pin_memory": pin_memory,
              "persistent_workers": workers > 0}
    return (DataLoader(train, batch_size=plan.batch_size, shuffle=True,
                       drop_last=plan.drop_last, **common),
            DataLoader(val, batch_size=eval_batch_size or plan.batch_size, shuffle=False,
                       **common),
            train.classes)


# -- the run directory: one layout for `bayesify fit --out` and the script ----------------
#: ``run.json["paths"]``: relative paths in the record are relative to its directory
RUN_PATHS = "relative to this run directory"


def portable_path(value: str | None, run_dir: str | Path) -> str | None:
    """``value`` relative to ``run_dir`` when it names an existing file or folder (a run
    directory can then move with its data); anything else (``digits``, None) unchanged."""
    import os

    if value is None or not Path(value).exists():
        return value
    return os.path.relpath(Path(value).resolve(), Path(run_dir).resolve())


def run_path(run: dict[str, Any], key: str, run_dir: Path) -> str | None:
    """``run[key]`` as a usable path: resolved against ``run_dir`` in records that say
    their paths are relative (:data:`RUN_PATHS`); older records are read as written."""
    value = run.get(key)
    if value is None or run.get("paths") != RUN_PATHS or Path(value).is_absolute():
        return value
    candidate = run_dir / value
    return str(candidate) if candidate.exists() else value


def install_files(staging: Path, out: Path) -> list[Path]:
    """Move every file of ``staging`` into ``out``, remove ``staging``: a posterior
    (tensors + manifest) with one atomic commit, every other file one rename each."""
    import os
    import shutil

    from bayesify.persistence import MANIFEST_FILE, TENSOR_FILE
    from bayesify.posterior_commit import move_posterior

    moved = []
    if (staging / MANIFEST_FILE).is_file() and (staging / TENSOR_FILE).is_file():
        move_posterior(staging, out)  # never new tensors beside an old manifest
        moved += [out / TENSOR_FILE, out / MANIFEST_FILE]
    for src in sorted(p for p in staging.rglob("*") if p.is_file()):
        dst = out / src.relative_to(staging)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        moved.append(dst)
    shutil.rmtree(staging, ignore_errors=True)
    return moved


def check_resume_batch(resume: str | Path, *, batch_size: int, world_size: int) -> None:
    """Refuse, before anything runs, a resume whose global batch differs from the
    checkpoint's (data order and steps per epoch depend on it), naming the
    ``--batch-size`` that matches with this many processes."""
    from bayesify.train.checkpoint import load_resumable

    path, payload = load_resumable(resume)
    meta = payload.get("meta", {})
    saved = meta.get("options", {}).get("global_batch_size")
    if saved is None or int(saved) == batch_size * world_size:
        return
    saved, saved_world = int(saved), int(meta.get("world_size") or 1)
    hint = (f"pass --batch-size {saved // world_size} to resume with {world_size} process(es)"
            if saved % world_size == 0 else
            f"no per-process batch gives {saved} with {world_size} processes; launch "
            f"{saved_world}")
    raise BayesifyError(
        f"checkpoint {path.name} was written with a global batch of {saved} ({saved_world} "
        f"process(es) × {saved // saved_world}); this run has {world_size} process(es) × "
        f"--batch-size {batch_size} = {batch_size * world_size}: {hint} (or --resume none to "
        "start over)")


def save_posterior_files(bnn: Any, directory: str | Path, *,
                         extra: dict[str, Any] | None = None) -> list[Path]:
    """``bnn.save_posterior(dir)`` plus ``run.json`` (``extra``); returns the files written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    before = {p: p.stat().st_mtime_ns for p in directory.iterdir()}
    bnn.save_posterior(directory)
    if extra:  # a fresh temp file renamed into place: a kill never leaves half a run.json
        from bayesify.atomic_files import replace, write_temp

        text = json.dumps(extra, indent=2, default=str).encode()
        replace(write_temp(directory, text, prefix=".run-", suffix=".json.tmp"),
                directory / "run.json")
    return sorted(p for p in directory.iterdir()
                  if p.is_file() and before.get(p) != p.stat().st_mtime_ns)
