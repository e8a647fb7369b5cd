"""Model outputs → class logits (the one place that knows output types)."""

from __future__ import annotations

from typing import Any

import torch


def logits_of(output: Any) -> torch.Tensor:
    """Class logits from a model output (tensor, HF ``ModelOutput`` or tuple)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}")
