"""Content digests of tensors: the base-weight fingerprint taken when a model is wrapped.

The factory records :func:`tensor_digests` of the base ``state_dict`` before anything
changes; persistence and checkpoints compare fingerprints built from them.

The weights do not say what the network computes (the same weights run through GELU
or ReLU): the factory also records :func:`architecture_record`, every module in
``named_modules`` order with its class name and its settings (``extra_repr``:
``in_features=4``, ``approximate='tanh'``, ``eps=1e-05``, strides, padding, ...).
What it cannot see: functional calls inside a ``forward`` (``F.gelu`` in a custom
module), Python attributes a module does not print, and code changes that keep the
class name.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn

#: settings that do not change what a module computes
_NO_OP_SETTINGS = re.compile(r",?\s*inplace=(True|False)")


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """sha256 over ``(name, dtype, shape, bytes)`` of one tensor."""
    digest = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    if tensor.is_meta:  # a dry run on the meta device: no bytes to hash
        return digest.hexdigest()
    tensor = tensor.detach().cpu().contiguous()
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tensor_digests(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """:func:`tensor_digest` of every tensor of a ``state_dict``."""
    return {name: tensor_digest(name, state[name]) for name in state}


def fingerprint_from_digests(digests: Mapping[str, str]) -> str:
    """sha256 over the per-tensor digests in sorted name order."""
    return hashlib.sha256("\n".join(f"{k}={digests[k]}" for k in sorted(digests)).encode()).hexdigest()


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """Fingerprint of a ``state_dict``: :func:`fingerprint_from_digests` of its tensors."""
    return fingerprint_from_digests(tensor_digests(state))


def _settings(module: nn.Module) -> str:
    try:
        text = module.extra_repr()
    except Exception:  # noqa: BLE001 - a custom extra_repr that fails says nothing
        return ""
    return _NO_OP_SETTINGS.sub("", str(text)).strip(", ")


def architecture_record(model: nn.Module) -> list[list[str]]:
    """``[name, class name, settings]`` of every module of ``model`` in order (see the
    module docstring for what this does and does not cover)."""
    return [[name, type(module).__qualname__, _settings(module)]
            for name, module in model.named_modules()]


def architecture_fingerprint(record: Sequence[Sequence[str]]) -> str:
    """sha256 of an :func:`architecture_record`."""
    return hashlib.sha256(json.dumps([list(r) for r in record]).encode()).hexdigest()


def first_architecture_difference(saved: Sequence[Sequence[str]],
                                  current: Sequence[Sequence[str]]) -> str:
    """Where two architecture records first differ, in words."""
    def show(entry: Sequence[str]) -> str:
        return f"{entry[1]}({entry[2]})"

    for old, new in zip(saved, current):
        old, new = list(old), list(new)
        if old[0] != new[0]:
            return f"module {old[0]!r} was saved where this model has {new[0]!r}"
        if old != new:
            return f"module {old[0] or '(root)'!r} is {show(new)} here but was {show(old)}"
    if len(saved) != len(current):
        return f"the model has {len(current)} modules, the saved one had {len(saved)}"
    return "the module settings differ"
