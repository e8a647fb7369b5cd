"""Models and datasets named on the command line.

Models: ``digits-cnn`` (the demo CNN), ``timm:NAME`` or ``torchvision:NAME``,
optionally with ``--checkpoint PATH`` (a ``state_dict`` read with
``torch.load(weights_only=True)`` or safetensors; nothing is unpickled).
Data: ``digits`` (the embedded scikit-learn digits protocol: classes 0–4 in
distribution, 5–9 out of distribution) or an ImageFolder directory with
``train/`` and ``val/`` (and optionally ``test/``) subfolders, preprocessed the
way the model expects (timm ``resolve_model_data_config`` / ``create_transform``;
torchvision ``weights.transforms()``, or the standard ImageNet transforms
without weights).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bayesify.errors import BayesifyError

DIGITS = "digits"
DIGITS_CNN = "digits-cnn"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``"timm:resnet50"`` → ``("timm", "resnet50")``; ``"digits-cnn"`` → ``("digits-cnn", "")``."""
    if spec == DIGITS_CNN:
        return DIGITS_CNN, ""
    source, _, name = spec.partition(":")
    if source not in ("timm", "torchvision") or not name:
        raise BayesifyError(f"unknown model {spec!r}; use 'digits-cnn', 'timm:NAME' "
                            "(e.g. timm:resnet50) or 'torchvision:NAME' (e.g. torchvision:resnet50)")
    return source, name


def create_model(spec: str, *, num_classes: int, in_channels: int = 3,
                 pretrained: bool = False, checkpoint: str | os.PathLike | None = None) -> nn.Module:
    """Build the named model with ``num_classes`` outputs (eval mode), then load ``checkpoint``."""
    source, name = parse_model_spec(spec)
    if source == DIGITS_CNN:
        if pretrained:
            raise BayesifyError("digits-cnn has no hub weights: pass --checkpoint or let "
                                "`bayesify fit` train it (--map-epochs)")
        from bayesify.data.models import DigitsCNN

        model: nn.Module = DigitsCNN(num_classes, in_channels=in_channels)
    elif source == "timm":
        import timm

        try:
            model = timm.create_model(name, pretrained=pretrained, num_classes=num_classes,
                                      in_chans=in_channels)
        except RuntimeError as err:  # timm raises RuntimeError for unknown names
            raise BayesifyError(f"timm cannot create {name!r}: {err}") from err
    else:
        import torchvision

        if name not in torchvision.models.list_models():
            raise BayesifyError(f"torchvision has no model {name!r}; see "
                                "torchvision.models.list_models()")
        if pretrained and num_classes != 1000:
            raise BayesifyError("torchvision hub weights have 1000 classes; for another head "
                                "use timm:NAME --pretrained or --checkpoint PATH")
        model = torchvision.models.get_model(
            name, weights="DEFAULT" if pretrained else None, num_classes=num_classes)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model.eval()


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A ``state_dict`` from ``.safetensors`` or a torch file (``weights_only=True``).

    Accepts a plain state dict or one nested under ``state_dict`` / ``model``;
    strips a DDP ``module.`` prefix.
    """
    path = Path(path)
    if not path.is_file():
        raise BayesifyError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(path))
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


def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a state dict file into ``model`` strictly; mismatches are a ``BayesifyError``."""
    state = read_state_dict(path)
    hint = "(wrong --model or a different number of classes?)"
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise BayesifyError(f"checkpoint {path} does not fit {type(model).__name__}: "
                            f"{err} {hint}") from err
    if result.missing_keys or result.unexpected_keys:
        raise BayesifyError(
            f"checkpoint {path} does not fit {type(model).__name__}: missing "
            f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]} {hint}"
        )
    return model


def save_checkpoint(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save ``model.state_dict()`` as safetensors (independent contiguous copies)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", copy=True).contiguous()
               for k, v in model.state_dict().items()}, str(path))
    return path


def model_transform(model: nn.Module, spec: str, *, image_size: int | None = None,
                    pretrained: bool = False) -> Callable:
    """PIL image → tensor preprocessing the model expects (eval transforms)."""
    from torchvision import transforms

    source, name = parse_model_spec(spec)
    if source == "timm":
        from timm.data import create_transform, resolve_model_data_config

        args = {"input_size": (3, image_size, image_size)} if image_size else None
        return create_transform(**resolve_model_data_config(model, args=args), is_training=False)
    if source == "torchvision" and pretrained and image_size is None:
        import torchvision

        return torchvision.models.get_model_weights(name).DEFAULT.transforms()
    if source == "torchvision":
        size = image_size or 224
        return transforms.Compose([
            transforms.Resize(round(size / 0.875)), transforms.CenterCrop(size),
            transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ])
    size = image_size or 32
    return transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor()])


@dataclass
class DataBundle:
    """Train / val / test datasets (and OOD when the protocol has one)."""

    train: Dataset
    val: Dataset
    test: Dataset
    num_classes: int
    ood: Dataset | None = None
    class_names: list[str] = field(default_factory=list)

    def loaders(self, *, batch_size: int = 64, seed: int = 0, workers: int = 0,
                eval_batch_size: int | None = None) -> dict[str, DataLoader]:
        """Shuffled (seeded) train loader and ordered evaluation loaders."""
        eval_bs = eval_batch_size or max(batch_size, 256)
        generator = torch.Generator().manual_seed(seed)
        out = {"train": DataLoader(self.train, batch_size=batch_size, shuffle=True,
                                   generator=generator, num_workers=workers)}
        for split in ("val", "test", "ood"):
            dataset = getattr(self, split)
            if dataset is not None:
                out[split] = DataLoader(dataset, batch_size=eval_bs, num_workers=workers)
        return out


def _folder_split(root: Path, split: str) -> Path:
    path = root / split
    if not path.is_dir():
        raise BayesifyError(f"--data {root}: expected an ImageFolder directory with train/ and "
                            f"val/ subfolders (one folder per class inside each); {path} is missing")
    return path


def data_classes(data: str) -> list[str]:
    """Class names of ``--data`` (digits: the in-distribution digits 0–4)."""
    if data == DIGITS:
        return [str(c) for c in range(5)]
    from torchvision.datasets.folder import find_classes

    try:
        return find_classes(str(_folder_split(Path(data), "train")))[0]
    except FileNotFoundError as err:
        raise BayesifyError(f"--data {data}: {err}") from err


def model_input(spec: str, data: str, image_size: int | None) -> tuple[int, int | None]:
    """``(in_channels, image_size)`` the model sees: digits-cnn on digits is 1×8×8."""
    source, _ = parse_model_spec(spec)
    if data == DIGITS:
        if source == DIGITS_CNN:
            return 1, image_size or 8
        return 3, image_size or 32
    return 3, image_size


def build_data(data: str, model: nn.Module, spec: str, *, image_size: int | None = None,
               pretrained: bool = False, seed: int = 0,
               ood: str | os.PathLike | None = None) -> DataBundle:
    """Datasets of ``--data`` preprocessed for ``model`` (see module docstring)."""
    channels, size = model_input(spec, data, image_size)
    if data == DIGITS:
        from bayesify.data.digits import load_digits_splits

        splits = load_digits_splits(seed=seed, size=size or 8, channels=channels)
        return DataBundle(train=splits.train, val=splits.val, test=splits.test, ood=splits.ood,
                          num_classes=splits.num_classes, class_names=data_classes(data))
    from torchvision.datasets import ImageFolder

    root = Path(data)
    transform = model_transform(model, spec, image_size=size, pretrained=pretrained)
    train = ImageFolder(str(_folder_split(root, "train")), transform=transform)
    val = ImageFolder(str(_folder_split(root, "val")), transform=transform)
    if val.classes != train.classes:
        raise BayesifyError(f"train/ and val/ of {root} have different classes: "
                            f"{train.classes} vs {val.classes}")
    test = ImageFolder(str(root / "test"), transform=transform) if (root / "test").is_dir() else val
    ood_set = ImageFolder(str(ood), transform=transform) if ood is not None else None
    return DataBundle(train=train, val=val, test=test, ood=ood_set,
                      num_classes=len(train.classes), class_names=list(train.classes))
