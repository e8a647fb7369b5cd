"""Input preprocessing as data: written into exports, applied again at deployment.

An exported predictor takes tensors; what turned an image into that tensor (resize,
crop, scaling to [0, 1], mean/std) is part of the model. :func:`describe_transform`
turns a torchvision / timm eval transform into a JSON description::

    {"source": "timm resolve_model_data_config",
     "steps": [{"op": "resize", "size": 235, "interpolation": "bicubic"},
               {"op": "center_crop", "size": [224, 224]},
               {"op": "to_tensor"},                       # uint8 HWC → float CHW in [0, 1]
               {"op": "normalize", "mean": [...], "std": [...]}],
     "input_size": [3, 224, 224], "mean": [...], "std": [...], "interpolation": "bicubic"}

and :func:`apply_preprocessing` replays it on PIL images or uint8 / float image
tensors. A step it cannot replay is recorded as ``{"op": "note", "text": ...}`` (the
description stays honest; replaying it is refused with the text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from bayesify.errors import BayesifyError

OPS = ("resize", "center_crop", "to_tensor", "normalize", "note")


def _floats(values: Any) -> list[float]:
    return [float(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def _size(value: Any) -> int | list[int]:
    if isinstance(value, int):
        return value
    values = [int(v) for v in value]
    return values[0] if len(values) == 1 else values


def _interpolation(mode: Any) -> str:
    return str(getattr(mode, "value", mode))


def _steps(transform: Any) -> list[dict[str, Any]]:
    from torchvision import transforms as T

    name = type(transform).__name__
    if isinstance(transform, T.Compose):
        return [s for t in transform.transforms for s in _steps(t)]
    if name == "ImageClassification":  # torchvision weights.transforms()
        return [{"op": "resize", "size": _size(transform.resize_size),
                 "interpolation": _interpolation(transform.interpolation)},
                {"op": "center_crop", "size": _size(transform.crop_size)},
                {"op": "to_tensor"},
                {"op": "normalize", "mean": _floats(transform.mean), "std": _floats(transform.std)}]
    if isinstance(transform, T.Resize):
        return [{"op": "resize", "size": _size(transform.size),
                 "interpolation": _interpolation(transform.interpolation)}]
    if isinstance(transform, T.CenterCrop):
        return [{"op": "center_crop", "size": _size(transform.size)}]
    if isinstance(transform, T.ToTensor) or name == "MaybeToTensor":
        return [{"op": "to_tensor"}]
    if isinstance(transform, T.Normalize):
        return [{"op": "normalize", "mean": _floats(transform.mean), "std": _floats(transform.std)}]
    return [{"op": "note", "text": repr(transform)}]


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """``input_size`` / ``mean`` / ``std`` / ``interpolation`` / ``resize`` read off the steps."""
    out: dict[str, Any] = {}
    for entry in steps:
        if entry["op"] == "resize":
            out["resize"], out["interpolation"] = entry["size"], entry.get("interpolation")
        elif entry["op"] == "center_crop":
            size = entry["size"]
            out["crop"] = [size, size] if isinstance(size, int) else list(size)
        elif entry["op"] == "normalize":
            out["mean"], out["std"] = entry["mean"], entry["std"]
    if "crop" in out:
        out["input_size"] = [len(out.get("mean", [0, 0, 0])), *out["crop"]]
    return out


def describe_transform(transform: Any, *, source: str = "user") -> dict[str, Any]:
    """A JSON description of an eval transform (see the module docstring)."""
    steps = _steps(transform)
    return {"source": source, "steps": steps, **summarize(steps)}


def check_description(description: Any) -> dict[str, Any]:
    """Validate a user-given description (a dict with ``steps`` of known ops)."""
    if not isinstance(description, dict) or not isinstance(description.get("steps"), list):
        raise BayesifyError("preprocessing must be a transform, None, 'auto' or a dict with a "
                            "'steps' list (see bayesify.predict.preprocessing)")
    for entry in description["steps"]:
        if not isinstance(entry, dict) or entry.get("op") not in OPS:
            raise BayesifyError(f"unknown preprocessing entry {entry!r}; ops: {OPS}")
    return {"source": "user", **summarize(description["steps"]), **description}


def model_preprocessing(model: torch.nn.Module) -> dict[str, Any] | None:
    """The eval preprocessing a timm model declares (``pretrained_cfg``), else ``None``
    (a torchvision model does not know its weights: pass ``preprocessing=``)."""
    if getattr(model, "pretrained_cfg", None) is None:
        return None
    try:
        from timm.data import create_transform, resolve_model_data_config
    except ImportError:
        return None
    config = resolve_model_data_config(model)
    return describe_transform(create_transform(**config, is_training=False),
                              source="timm resolve_model_data_config")


def resolve_preprocessing(preprocessing: Any, model: torch.nn.Module | None) -> dict[str, Any] | None:
    """``"auto"`` (the model's own, when it declares one), ``None``, a dict or a transform."""
    if preprocessing is None:
        return None
    if isinstance(preprocessing, str):
        if preprocessing != "auto":
            raise BayesifyError(f"preprocessing={preprocessing!r}: use 'auto', None, a dict or "
                                "a torchvision transform")
        return model_preprocessing(model) if model is not None else None
    if isinstance(preprocessing, dict):
        return check_description(preprocessing)
    return describe_transform(preprocessing)


def _one(image: Any, steps: list[dict[str, Any]]) -> torch.Tensor:
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    x = image
    if not isinstance(x, torch.Tensor) and getattr(x, "mode", "RGB") not in ("RGB", "L"):
        x = x.convert("RGB")
    for entry in steps:
        op = entry["op"]
        if op == "resize":
            x = F.resize(x, entry["size"], antialias=True,
                         interpolation=InterpolationMode(entry.get("interpolation", "bilinear")))
        elif op == "center_crop":
            x = F.center_crop(x, entry["size"])
        elif op == "to_tensor":
            if not isinstance(x, torch.Tensor):
                x = F.to_tensor(x)
            elif not x.is_floating_point():
                x = x.float() / 255.0
        elif op == "normalize":
            x = F.normalize(x if isinstance(x, torch.Tensor) else F.to_tensor(x),
                            entry["mean"], entry["std"])
        else:
            raise BayesifyError(f"this export's preprocessing cannot be replayed: {entry['text']}; "
                                "prepare the input tensor yourself")
    if not isinstance(x, torch.Tensor):
        x = F.to_tensor(x)
    return x


def apply_preprocessing(description: dict[str, Any] | None, images: Any) -> torch.Tensor:
    """``[B, C, H, W]`` float input from PIL images or image tensors (``[C, H, W]``,
    ``[B, C, H, W]``; uint8 in 0–255 or float in [0, 1]) by the recorded steps."""
    if description is None:
        raise BayesifyError("this export records no preprocessing; pass export(..., "
                            "preprocessing=transform) when exporting, or prepare inputs yourself")
    if isinstance(images, torch.Tensor) and images.dim() == 4:
        images = list(images.unbind(0))
    elif isinstance(images, torch.Tensor) or not isinstance(images, Sequence):
        images = [images]
    return torch.stack([_one(image, description["steps"]) for image in images])
