"""Input corruptions of the evaluation protocol."""

from __future__ import annotations

import torch


def gaussian_mix(x: torch.Tensor, gamma: float, *, seed: int = 0) -> torch.Tensor:
    """``x̂ = (1 − γ)·x + γ·ε`` with ``ε ~ N(0, 1)`` (seeded), for γ ∈ [0, 1]."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    generator = torch.Generator().manual_seed(seed)
    eps = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device, x.dtype)
    return (1.0 - gamma) * x + gamma * eps
