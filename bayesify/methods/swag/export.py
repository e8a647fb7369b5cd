"""Export of SWAG: the N sampled networks of the predictor as plain module copies.

Member ``m`` of a SWAG predictor is the network with weights
``θ_m = θ̄ + sqrt(scale)·(sqrt(diag) ⊙ z1 + Dᵀ z2 / sqrt(R − 1))`` drawn from
``member_generator(seed, m)`` and BatchNorm statistics recomputed for ``θ_m``
(``SWAGMethod.member_batchnorm``, cached per seed). Export materialises exactly those
N state dicts into N copies of the unwrapped network, stacked as ``x → [N, B, C]``:
the graph holds plain convs / matmuls (no sampling, no bayesify).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel
    from bayesify.methods.swag.method import SWAGMethod


def _unwrapped_name(name: str) -> str:
    """``"fc.theta.weight" → "fc.weight"`` (functional_call key → unwrapped module key)."""
    parts = [p for p in name.split(".") if p not in ("base_layer", "theta")]
    return ".".join(parts).replace("__", ".")


@torch.no_grad()
def member_network(bnn: BayesianModel, state: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of the unwrapped network carrying ``state`` (sampled weights + BN statistics)."""
    net = bnn.unwrap().eval()
    targets = dict(net.named_parameters())
    targets.update(dict(net.named_buffers()))
    for key, value in state.items():
        target = targets[_unwrapped_name(key)]
        target.copy_(value.to(target.device, target.dtype))
    return net


def export_swag(method: SWAGMethod, bnn: BayesianModel, *, samples_per_component: int,
                seed: int, example_input: torch.Tensor, deterministic: bool) -> nn.Module:
    """``x → [N, B, C]``: the predictor's N sampled networks (1 for 'swa' / deterministic)."""
    from bayesify.kit.stacked import StackedModels

    layers = method._layers(bnn)
    if deterministic or method.config.variant == "swa" or not bnn.state.value("swag_fitted"):
        # in process: θ̄ (the working copies) with the BatchNorm statistics of θ̄
        mean = {f"{n}.theta.{k}": v.detach() for n, layer in layers.items()
                for k, v in layer.theta.items()}
        for n, w in method._bn_wrappers(bnn).items():
            mean.update({f"{n}.running_mean": w.running_mean, f"{n}.running_var": w.running_var})
        return StackedModels([member_network(bnn, mean)])
    num = samples_per_component
    bn_stats = method.member_batchnorm(bnn, num, seed)
    return StackedModels([member_network(bnn, {**method.sample(bnn, m, seed), **bn_stats[m]})
                          for m in range(num)])
