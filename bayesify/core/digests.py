"""Content digests of tensors: the base-weight fingerprint taken when a model is wrapped.

The factory records :func:`tensor_digests` of the base ``state_dict`` before anything
changes; persistence and checkpoints compare fingerprints built from them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


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
