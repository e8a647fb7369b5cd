"""Reusable pieces of the ImageNet fine-tuning script (``examples/finetune_imagenet.py``).

- :func:`load_model`: ``"timm:NAME"`` or ``"torchvision:NAME"``, pretrained from the
  hub (when online) or weights from a local file (safetensors or a ``torch.save``
  state dict read with ``weights_only=True``).
- :func:`build_transforms`: the model's own preprocessing — timm's
  ``resolve_data_config`` / ``create_transform``, torchvision's
  ``weights.transforms()`` (train: random-resized crop + flip with the same mean,
  std and crop size), or standard ImageNet transforms when neither applies.
- :func:`image_folder_loaders`: ``DIR/train`` and ``DIR/val`` as ``ImageFolder``.
- :func:`add_method_options` / :func:`method_options`: one command-line flag per
  config field of every registered family, with the field's own help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bayesify.data.sources import read_state_dict
from bayesify.errors import BayesifyError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SOURCES = ("timm", "torchvision")


@dataclass
class ModelInfo:
    """Where a model came from (enough to rebuild its preprocessing)."""

    source: str
    name: str
    weights: Any = None  # torchvision weights enum member, if any


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``"timm:resnet50"`` → ``("timm", "resnet50")``."""
    source, sep, name = spec.partition(":")
    if not sep or source not in SOURCES or not name:
        raise BayesifyError(
            f"model {spec!r} is not SOURCE:NAME with SOURCE in {SOURCES}, e.g. "
            "'timm:resnet50' or 'torchvision:resnet50'"
        )
    return source, name


def load_model(
    spec: str,
    *,
    pretrained: bool = False,
    checkpoint: str | Path | None = None,
    num_classes: int | None = None,
    weights: str | None = None,
) -> tuple[nn.Module, ModelInfo]:
    """Build ``spec`` and load its weights; returns the model in eval mode.

    ``pretrained``: hub weights (timm: the default tag; torchvision: ``weights``,
    default ``"DEFAULT"``). ``checkpoint``: a local weights file, loaded strictly.
    ``num_classes``: size of the classifier (default: the architecture's).
    """
    source, name = parse_model_spec(spec)
    if pretrained and checkpoint is not None:
        raise BayesifyError("use either --pretrained or --checkpoint, not both")
    extra = {} if num_classes is None else {"num_classes": int(num_classes)}
    try:
        if source == "timm":
            import timm

            model = timm.create_model(name, pretrained=pretrained, **extra)
            info = ModelInfo(source, name)
        else:
            import torchvision

            enum = _torchvision_weights(name, weights or "DEFAULT")
            model = torchvision.models.get_model(name, weights=enum if pretrained else None, **extra)
            info = ModelInfo(source, name, enum)
    except BayesifyError:
        raise
    except Exception as err:  # unknown name, no network, …
        hint = "; offline? pass --checkpoint PATH instead" if pretrained else ""
        raise BayesifyError(f"cannot build {spec!r}: {type(err).__name__}: {err}{hint}") from err
    if checkpoint is not None:
        state = read_state_dict(checkpoint)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise BayesifyError(
                f"weights in {str(checkpoint)!r} do not fit {spec!r} "
                f"(num_classes={num_classes}): {str(err).splitlines()[0]}"
            ) from err
    return model.eval(), info


def _torchvision_weights(name: str, tag: str) -> Any:
    """The torchvision weights enum member ``tag`` of ``name`` (``None`` if none exist)."""
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):
        return None
    try:
        return enum.DEFAULT if tag == "DEFAULT" else enum[tag]
    except KeyError:
        raise BayesifyError(
            f"torchvision model {name!r} has no weights {tag!r}; available: "
            f"{[w.name for w in enum]}"
        ) from None


def build_transforms(model: nn.Module, info: ModelInfo, *, image_size: int | None = None) -> tuple[Any, Any]:
    """``(train_transform, eval_transform)`` from the model's own preprocessing config.

    ``image_size`` overrides the crop size (e.g. 32 for tests); the resize keeps
    the model's crop ratio.
    """
    from torchvision import transforms as T

    if info.source == "timm":
        from timm.data import create_transform, resolve_data_config

        overrides = {} if image_size is None else {"input_size": (3, image_size, image_size)}
        cfg = resolve_data_config(overrides, model=model)
        return create_transform(**cfg, is_training=True), create_transform(**cfg, is_training=False)
    mean, std, crop, resize = IMAGENET_MEAN, IMAGENET_STD, 224, 256
    interpolation = T.InterpolationMode.BILINEAR
    if info.weights is not None:
        preset = info.weights.transforms()
        mean, std = tuple(preset.mean), tuple(preset.std)
        crop, resize = preset.crop_size[0], preset.resize_size[0]
        interpolation = preset.interpolation
        if image_size is None:
            eval_tf = preset
    if image_size is not None:
        resize, crop = max(round(image_size * resize / crop), image_size), image_size
    if image_size is not None or info.weights is None:
        eval_tf = T.Compose([T.Resize(resize, interpolation=interpolation), T.CenterCrop(crop),
                             T.ToTensor(), T.Normalize(mean, std)])
    train_tf = T.Compose([T.RandomResizedCrop(crop, interpolation=interpolation),
                          T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    return train_tf, eval_tf


def image_folder_loaders(
    data_dir: str | Path,
    train_transform: Any,
    eval_transform: Any,
    *,
    batch_size: int,
    workers: int,
    eval_batch_size: int | None = None,
    pin_memory: bool = False,
) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader, list[str]]:
    """Shuffled ``DIR/train`` and ordered ``DIR/val`` loaders, and the class names.

    ``batch_size`` is per process; ``bayesify.fit`` shards the shuffled order over
    ranks under ``torchrun`` (global batch = batch_size × world size).
    """
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    root = Path(data_dir)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise BayesifyError(f"{str(root / split)!r} is missing; --data needs train/ and val/ "
                                "ImageFolder directories (one sub-folder per class)")
    train = ImageFolder(str(root / "train"), transform=train_transform)
    val = ImageFolder(str(root / "val"), transform=eval_transform)
    if train.classes != val.classes:
        raise BayesifyError("train/ and val/ have different class folders")
    common = {"num_workers": workers, "pin_memory": pin_memory,
              "persistent_workers": workers > 0}
    return (DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True, **common),
            DataLoader(val, batch_size=eval_batch_size or batch_size, shuffle=False, **common),
            train.classes)


# -- one flag per config field of every family -------------------------------------------

def _fields_by_name() -> dict[str, dict[str, dataclasses.Field]]:
    from bayesify.core.registry import get_method_class, list_methods

    out: dict[str, dict[str, dataclasses.Field]] = {}
    for method in list_methods():
        try:
            cls = get_method_class(method).config_cls
        except ImportError:  # a family whose optional dependency is missing
            continue
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, {})[method] = f
    return out


def _value(text: str) -> Any:
    """A command-line value: JSON when it parses (numbers, true/false, null), else text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def add_method_options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Add ``--field-name`` for every config field of every registered family.

    Flags default to "not given" (the family's own default applies). A field
    whose name collides with a flag of the script gets a ``--cfg-`` prefix.
    Returns ``{argparse dest: field name}``.
    """
    group = parser.add_argument_group(
        "posterior options (fields of the --method config; unset = the family's default)")
    dests: dict[str, str] = {}
    for name, per_method in sorted(_fields_by_name().items()):
        defaults = {m: f.default for m, f in per_method.items()}
        helps = {f.metadata.get("help", "") for f in per_method.values()}
        help_text = " / ".join(sorted(h for h in helps if h)) or name
        where = ", ".join(f"{m}: {json.dumps(d, default=str)}" for m, d in sorted(defaults.items()))
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS,
                                  "help": f"{help_text} [default {where}]"}
        if all(isinstance(d, bool) for d in defaults.values()):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name == "targets" or any(isinstance(d, tuple) for d in defaults.values()):
            kwargs.update(nargs="+", type=_value, metavar="V")
        else:
            kwargs.update(type=_value, metavar="V")
        dest = f"cfg_{name}"
        flag = "--" + name.replace("_", "-")
        try:
            group.add_argument(flag, dest=dest, **kwargs)
        except argparse.ArgumentError:
            group.add_argument("--cfg-" + name.replace("_", "-"), dest=dest, **kwargs)
        dests[dest] = name
    return dests


def method_options(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The config options given on the command line, typed for ``method``."""
    from bayesify.core.registry import get_method_class

    fields = {f.name: f for f in dataclasses.fields(get_method_class(method).config_cls)}
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith("cfg_"):
            continue
        name = dest[len("cfg_"):]
        if name not in fields:
            raise BayesifyError(f"option --{name.replace('_', '-')} does not apply to method "
                                f"{method!r}; its options are {sorted(fields)}")
        default = fields[name].default
        if isinstance(value, list) and not isinstance(default, tuple) and len(value) == 1:
            value = value[0]
        elif isinstance(value, list):
            value = tuple(value)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        out[name] = value
    return out


def save_posterior_files(bnn: Any, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
    """``bnn.save_posterior(dir)`` when available, else safetensors + a JSON manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(bnn, "save_posterior"):
        bnn.save_posterior(directory)
    else:
        from safetensors.torch import save_file

        tensors = {n: p.detach().to("cpu", copy=True).contiguous()
                   for n, p in bnn.named_posterior_parameters()}
        save_file(tensors, str(directory / "posterior.safetensors"))
        manifest = {"method": bnn.method_name, "config": bnn.config.to_dict(),
                    "targets": list(bnn.targets)}
        (directory / "bayesify.json").write_text(json.dumps(manifest, indent=2, default=str))
    if extra:
        (directory / "run.json").write_text(json.dumps(extra, indent=2, default=str))
    return directory
