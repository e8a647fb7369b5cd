"""Where a base model comes from: one module for the CLI and the ImageNet script.

Models are named ``digits-cnn`` (the demo CNN), ``timm:NAME`` or
``torchvision:NAME``. Weights come from the hub (``pretrained=True``, needs
network access) or from a local file (:func:`read_state_dict`: ``.safetensors``
or a ``torch.save`` state dict read with ``weights_only=True``; nothing is
unpickled). The number of classes is checked against the checkpoint's
classifier head before loading (:func:`checkpoint_head`), so a mismatch names
both numbers instead of printing a wall of missing keys.

Preprocessing is the model's own (:func:`model_transforms`): timm
``resolve_model_data_config`` / ``create_transform``, torchvision
``weights.transforms()`` (train: random-resized crop + flip with the same mean,
std and crop), the standard ImageNet transforms when neither applies.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bayesify.errors import BayesifyError

DIGITS_CNN = "digits-cnn"
SOURCES = ("timm", "torchvision")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``"timm:resnet50"`` → ``("timm", "resnet50")``; ``"digits-cnn"`` → ``("digits-cnn", "")``."""
    if spec == DIGITS_CNN:
        return DIGITS_CNN, ""
    source, sep, name = str(spec).partition(":")
    if not sep or source not in SOURCES or not name:
        raise BayesifyError(f"unknown model {spec!r}: use SOURCE:NAME with SOURCE in {SOURCES} "
                            "(e.g. 'timm:resnet50' or 'torchvision:resnet50') or 'digits-cnn'")
    return source, name


def torchvision_weights(name: str, tag: str | None = None) -> Any:
    """The torchvision weights enum member ``tag`` (default ``DEFAULT``) of ``name``, or ``None``.

    Only the enum is looked up (its ``transforms()`` need no download).
    """
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):
        return None
    tag = tag or "DEFAULT"
    try:
        return enum.DEFAULT if tag == "DEFAULT" else enum[tag]
    except KeyError:
        raise BayesifyError(f"torchvision model {name!r} has no weights {tag!r}; available: "
                            f"{[w.name for w in enum]}") from None


def check_model_name(spec: str) -> None:
    """Refuse an unknown architecture name without building anything."""
    source, name = parse_model_spec(spec)
    if source == "timm":
        import timm

        if not timm.is_model(name):
            raise BayesifyError(f"timm has no model {name!r}; see timm.list_models('{name}*')")
    elif source == "torchvision":
        import torchvision

        if name not in torchvision.models.list_models():
            raise BayesifyError(f"torchvision has no model {name!r}; see "
                                "torchvision.models.list_models()")


def create_model(
    spec: str,
    *,
    num_classes: int | None = None,
    in_channels: int = 3,
    pretrained: bool = False,
    weights: str | None = None,
    checkpoint: str | os.PathLike | None = None,
    classes_from: str = "--num-classes",
) -> nn.Module:
    """Build ``spec`` with ``num_classes`` outputs (eval mode) and load its weights.

    ``pretrained``: hub weights (timm: the default tag; torchvision: ``weights``,
    default ``DEFAULT``). ``checkpoint``: a local weights file, loaded strictly
    after its classifier head was checked against ``num_classes`` (taken, says
    ``classes_from``, from e.g. the ImageFolder). ``num_classes=None``: the
    architecture's default, or the checkpoint head's size when there is one.
    """
    source, name = parse_model_spec(spec)
    if pretrained and checkpoint is not None:
        raise BayesifyError("use either --pretrained or --checkpoint, not both")
    state = read_state_dict(checkpoint) if checkpoint is not None else None
    model = _build(source, name, num_classes=num_classes, in_channels=in_channels,
                   pretrained=pretrained, weights=weights)
    if state is not None:
        head = checkpoint_head(model, state)
        if head is not None and num_classes is None and head[1] != _out_features(model, head[0]):
            # no class count given: the checkpoint's head decides
            model = _build(source, name, num_classes=head[1], in_channels=in_channels,
                           pretrained=False, weights=None)
        elif head is not None and num_classes is not None and head[1] != num_classes:
            key, size = head
            raise BayesifyError(
                f"--checkpoint {checkpoint} has a {size}-class head ({key}: "
                f"{tuple(state[key].shape)}) but {classes_from} gives {num_classes} classes; "
                "use a checkpoint fine-tuned on these classes, or data with the checkpoint's "
                "classes"
            )
        load_state(model, state, where=str(checkpoint))
    return model.eval()


def _build(source: str, name: str, *, num_classes: int | None, in_channels: int,
           pretrained: bool, weights: str | None) -> nn.Module:
    extra = {} if num_classes is None else {"num_classes": int(num_classes)}
    if source == DIGITS_CNN:
        if pretrained:
            raise BayesifyError("digits-cnn has no hub weights: pass --checkpoint or let "
                                "`bayesify fit` train it (--map-epochs)")
        from bayesify.data.models import DigitsCNN

        return DigitsCNN(num_classes or 5, in_channels=in_channels)
    check_model_name(f"{source}:{name}")
    try:
        if source == "timm":
            import timm

            return timm.create_model(name, pretrained=pretrained, in_chans=in_channels, **extra)
        import torchvision

        enum = torchvision_weights(name, weights) if pretrained else None
        if pretrained and num_classes not in (None, len(enum.meta.get("categories", ()))):
            raise BayesifyError(
                f"torchvision hub weights of {name!r} have {len(enum.meta['categories'])} "
                f"classes, the data {num_classes}; use timm:{name} --pretrained (it replaces "
                "the head) or --checkpoint PATH")
        return torchvision.models.get_model(name, weights=enum, **extra)
    except BayesifyError:
        raise
    except Exception as err:  # no network, bad keyword, …
        hint = "; offline? pass --checkpoint PATH instead" if pretrained else ""
        raise BayesifyError(f"cannot build '{source}:{name}': {type(err).__name__}: "
                            f"{err}{hint}") from err


def classifier_name(model: nn.Module) -> str | None:
    """Qualified name of the classifier head: timm's ``get_classifier()``, else the last Linear."""
    head = model.get_classifier() if callable(getattr(model, "get_classifier", None)) else None
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(head, nn.Module) and id(head) in names and hasattr(head, "weight"):
        return names[id(head)]
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linear[-1] if linear else None


def _out_features(model: nn.Module, key: str) -> int:
    return int(model.state_dict()[key].shape[0])


def checkpoint_head(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[str, int] | None:
    """``(weight key, number of classes)`` of the classifier in ``state``, or ``None``."""
    name = classifier_name(model)
    key = f"{name}.weight" if name else None
    if key is None or key not in state or key not in model.state_dict():
        return None
    return key, int(state[key].shape[0])


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A ``state_dict`` from ``.safetensors`` or a torch file (``weights_only=True``).

    Accepts a plain state dict or one nested under ``state_dict`` / ``model``;
    strips a DDP ``module.`` prefix.
    """
    path = Path(path)
    if not path.is_file():
        raise BayesifyError(f"checkpoint {path} does not exist (or is not a file)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state: Any = load_file(str(path))
        except Exception as err:
            raise BayesifyError(f"cannot read {path} as safetensors: {err}") from err
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise BayesifyError(f"cannot read {path} as a weights-only torch checkpoint "
                                f"(pickled objects are refused): {err}") from err
    for key in ("state_dict", "model", "model_state_dict", "module"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BayesifyError(f"{path} does not hold a state_dict of tensors")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_state(model: nn.Module, state: dict[str, torch.Tensor], *, where: str) -> nn.Module:
    """Load ``state`` into ``model`` strictly; mismatches are a ``BayesifyError``."""
    hint = "(wrong --model, or weights of another architecture?)"
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        first = str(err).strip().splitlines()
        raise BayesifyError(f"weights in {where} do not fit {type(model).__name__}: "
                            f"{' '.join(first[:3])} {hint}") from err
    if result.missing_keys or result.unexpected_keys:
        raise BayesifyError(
            f"weights in {where} do not fit {type(model).__name__}: missing "
            f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]} {hint}"
        )
    return model


def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a state dict file into ``model`` strictly (see :func:`load_state`)."""
    return load_state(model, read_state_dict(path), where=str(path))


def save_checkpoint(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save ``model.state_dict()`` as safetensors (independent contiguous copies)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", copy=True).contiguous()
               for k, v in model.state_dict().items()}, str(path))
    return path


def model_transforms(model: nn.Module, spec: str, *, image_size: int | None = None,
                     weights: str | None = None) -> tuple[Callable, Callable]:
    """``(train_transform, eval_transform)`` PIL image → ``[C, H, W]`` tensor, as the model expects.

    ``image_size`` overrides the crop size (the resize keeps the model's crop
    ratio); ``weights``: the torchvision weights tag whose preset applies.
    """
    from torchvision import transforms as T

    source, name = parse_model_spec(spec)
    if source == "timm":
        from timm.data import create_transform, resolve_model_data_config

        args = {"input_size": (3, image_size, image_size)} if image_size else None
        cfg = resolve_model_data_config(model, args=args)
        return create_transform(**cfg, is_training=True), create_transform(**cfg, is_training=False)
    if source == DIGITS_CNN:
        size = image_size or 32
        tf = T.Compose([T.Resize((size, size)), T.ToTensor()])
        return tf, tf
    mean, std, crop, resize = IMAGENET_MEAN, IMAGENET_STD, 224, 256
    interpolation = T.InterpolationMode.BILINEAR
    preset = torchvision_weights(name, weights)
    eval_tf: Callable | None = None
    if preset is not None:
        tf = preset.transforms()
        mean, std = tuple(tf.mean), tuple(tf.std)
        crop, resize, interpolation = tf.crop_size[0], tf.resize_size[0], tf.interpolation
        eval_tf = tf if image_size is None else None
    if image_size is not None:
        resize, crop = max(round(image_size * resize / crop), image_size), image_size
    if eval_tf is None:
        eval_tf = T.Compose([T.Resize(resize, interpolation=interpolation), T.CenterCrop(crop),
                             T.ToTensor(), T.Normalize(mean, std)])
    train_tf = T.Compose([T.RandomResizedCrop(crop, interpolation=interpolation),
                          T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    return train_tf, eval_tf
