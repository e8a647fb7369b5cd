"""Input corruptions of the evaluation protocol.

Every corruption maps an image batch ``x [B, C, H, W]`` (or any ``[B, ...]`` for
the pointwise ones) and a severity ``level`` to a corrupted copy; level 0 is the
identity. Noise is seeded, so a sweep sees the same noise at every call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from bayesify.errors import BayesifyError

Corruption = Callable[..., torch.Tensor]


def gaussian_mix(x: torch.Tensor, gamma: float, *, seed: int = 0) -> torch.Tensor:
    """``x̂ = (1 − γ)·x + γ·ε`` with ``ε ~ N(0, 1)`` (seeded), for γ ∈ [0, 1]."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    generator = torch.Generator().manual_seed(seed)
    eps = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device, x.dtype)
    return (1.0 - gamma) * x + gamma * eps


def salt_and_pepper(
    x: torch.Tensor, p: float, *, seed: int = 0, low: float = 0.0, high: float = 1.0
) -> torch.Tensor:
    """Each value independently replaced with probability ``p``: half by ``low``, half by ``high``.

    ``x̂_i = x_i`` w.p. ``1 − p``, ``low`` w.p. ``p/2``, ``high`` w.p. ``p/2``. The mask
    is drawn per element (per channel too), as in the classical definition.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(x.shape, generator=generator, dtype=torch.float32).to(x.device)
    out = x.clone()
    out[u < p / 2] = low
    out[(u >= p / 2) & (u < p)] = high
    return out


def rotate(x: torch.Tensor, angle: float, *, seed: int = 0, fill: float = 0.0) -> torch.Tensor:
    """Rotate ``[B, C, H, W]`` images by ``angle`` degrees (counter-clockwise) about the centre.

    Bilinear resampling on the pixel grid; pixels coming from outside the image
    are ``fill``. ``seed`` is accepted (and ignored) so every corruption shares
    one signature. Rotation by 0 returns ``x`` unchanged; by 90° it equals
    ``torch.rot90`` on square images up to interpolation at the border.
    """
    if x.dim() != 4:
        raise BayesifyError(f"rotate expects images [B, C, H, W], got shape {tuple(x.shape)}")
    if angle % 360 == 0:
        return x.clone()
    theta = math.radians(angle)
    cos, sin = math.cos(theta), math.sin(theta)
    # affine_grid maps output coordinates to input coordinates: use the inverse rotation
    # (rows of the image grow downwards, so a CCW rotation on screen is +sin here)
    matrix = torch.tensor([[cos, -sin, 0.0], [sin, cos, 0.0]], dtype=torch.float32, device=x.device)
    grid = F.affine_grid(matrix.expand(x.shape[0], 2, 3), list(x.shape), align_corners=False)
    shifted = x.float() - fill
    out = F.grid_sample(shifted, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return (out + fill).to(x.dtype)


CORRUPTIONS: dict[str, Corruption] = {
    "gaussian": gaussian_mix,
    "salt_pepper": salt_and_pepper,
    "rotation": rotate,
}

#: default severity sweeps of the digits protocol (γ, p, degrees)
DEFAULT_SWEEPS: dict[str, tuple[float, ...]] = {
    "gaussian": (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
    "salt_pepper": (0.05, 0.1, 0.2, 0.3, 0.4, 0.5),
    "rotation": (15.0, 30.0, 45.0, 60.0, 75.0, 90.0),
}


def corrupt(x: torch.Tensor, kind: str, level: float, *, seed: int = 0) -> torch.Tensor:
    """Apply the corruption named ``kind`` (a key of :data:`CORRUPTIONS`) at ``level``."""
    if kind not in CORRUPTIONS:
        raise BayesifyError(f"unknown corruption {kind!r}; available: {', '.join(CORRUPTIONS)}")
    return CORRUPTIONS[kind](x, level, seed=seed)


def corrupted_loader(
    dataset: TensorDataset, kind: str, level: float, *, seed: int = 0, batch_size: int = 512
) -> DataLoader:
    """An ordered loader over ``dataset`` with its inputs corrupted once (labels kept)."""
    x, y = dataset.tensors[0], dataset.tensors[1]
    return DataLoader(TensorDataset(corrupt(x, kind, level, seed=seed), y), batch_size=batch_size)


def sweep_loaders(
    dataset: TensorDataset,
    sweeps: dict[str, Sequence[float]] | None = None,
    *,
    seed: int = 0,
    batch_size: int = 512,
) -> dict[str, list[tuple[float, DataLoader]]]:
    """``{kind: [(level, loader), ...]}`` for every corruption sweep."""
    sweeps = DEFAULT_SWEEPS if sweeps is None else sweeps
    return {
        # one noise draw per sweep: the levels differ only in severity
        kind: [(float(level), corrupted_loader(dataset, kind, level, seed=seed,
                                                batch_size=batch_size))
               for level in levels]
        for kind, levels in sweeps.items()
    }
