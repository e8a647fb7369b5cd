"""SWAG posterior over the wrapped parameters: flat views, sampling, distributed sums.

Sample (Maddox et al. eq. 1 with the diagonal and low-rank parts):

    θ = θ̄ + sqrt(scale) · ( sqrt(diag) ⊙ z1 + Dᵀ z2 / sqrt(R − 1) ),
    diag = max(mean(θ²) − θ̄², min_variance),  z1 ~ N(0, I_P),  z2 ~ N(0, I_R)

with R the number of deviations actually collected. ``z2`` is shared by every
layer (D is one ``[R, P]`` matrix over all wrapped parameters), so sampling is done
here for the whole model, never per layer.
"""

from __future__ import annotations

import math

import torch

from bayesify.core.names import base_name, dotted, flat_key
from bayesify.methods.swag.layers import SWAGLayer


def parameter_keys(layers: dict[str, SWAGLayer]) -> list[tuple[str, SWAGLayer, str]]:
    """``(name in the wrapped model, layer, moment key)`` of every SWAG parameter, in order."""
    out = []
    for lname, layer in layers.items():
        for pname in layer.param_names:
            key = flat_key(pname)
            out.append((theta_name(lname, key), layer, key))
    return out


def theta_name(layer: str, key: str) -> str:
    """functional_call key of the working copy ``theta[key]`` of SWAG layer ``layer``."""
    return f"{layer}.theta.{key}"


def base_parameter_name(name: str) -> str:
    """A functional_call key of a SWAG network → the base model's name: a working copy
    ``"fc.theta.weight"`` → ``"fc.weight"``; other keys (BatchNorm statistics) as given."""
    layer, sep, key = name.rpartition(".theta.")
    return base_name(f"{layer}.{dotted(key)}") if sep else base_name(name)


def collected_rank(layers: dict[str, SWAGLayer]) -> int:
    return min(layer.moments.collected_rank for layer in layers.values())


def snapshots(layers: dict[str, SWAGLayer]) -> int:
    return min(int(layer.moments.count) for layer in layers.values())


def flat_moments(layers: dict[str, SWAGLayer]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat ``mean [P]``, ``mean of squares [P]`` and deviations ``D [R, P]`` (small models/tests)."""
    keys = parameter_keys(layers)
    rank = collected_rank(layers)
    mean = torch.cat([layer.moments.mean(k).reshape(-1) for _, layer, k in keys])
    sq = torch.cat([layer.moments.sq_mean(k).reshape(-1) for _, layer, k in keys])
    dev = torch.cat([layer.moments.deviations(k)[:rank].reshape(rank, -1) for _, layer, k in keys], 1)
    return mean, sq, dev


@torch.no_grad()
def sample_parameters(
    layers: dict[str, SWAGLayer],
    *,
    variant: str,
    scale: float,
    generator: torch.Generator | None,
    device: torch.device,
    min_variance: float = 1e-30,
) -> dict[str, torch.Tensor]:
    """One sampled network: ``{"<layer>.theta.<param>": θ}`` on ``device``.

    ``variant='swa'`` returns the mean θ̄. The noise is drawn on the CPU from
    ``generator`` (z2 first, then z1 parameter by parameter), so a seed gives the
    same network on every device and for every chunking.
    """
    rank = collected_rank(layers)
    low_rank = variant == "swag" and rank >= 2
    z2 = torch.randn(rank, generator=generator) if low_rank else None
    root = math.sqrt(scale)
    out: dict[str, torch.Tensor] = {}
    for name, layer, key in parameter_keys(layers):
        moments = layer.moments
        mean = moments.mean(key)
        if variant == "swa":
            out[name] = mean.to(device)
            continue
        std = (moments.sq_mean(key) - mean * mean).clamp_min(min_variance).sqrt()
        z1 = torch.randn(mean.shape, generator=generator).to(mean.device, mean.dtype)
        noise = std * z1
        if low_rank:
            dev = moments.deviations(key)[:rank]
            noise = noise + torch.tensordot(z2.to(dev.device, dev.dtype), dev, dims=1) / math.sqrt(rank - 1)
        out[name] = (mean + root * noise).to(device)
    return out


def member_generator(seed: int | None, member: int) -> torch.Generator:
    """CPU generator of predictive member ``member`` (reproducible from the predictor seed)."""
    generator = torch.Generator()
    generator.manual_seed(((0 if seed is None else seed) * 1_000_003 + member * 7_919 + 17) % (2**62))
    return generator
