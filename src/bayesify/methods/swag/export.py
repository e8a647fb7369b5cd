"""Export of SWAG: the N sampled networks of the predictor as plain module copies.

Member ``m`` of a SWAG predictor is the network with weights
``θ_m = θ̄ + sqrt(scale)·(sqrt(diag) ⊙ z1 + Dᵀ z2 / sqrt(R − 1))`` drawn from
``member_generator(seed, m)`` and BatchNorm statistics recomputed for ``θ_m``
(:func:`bayesify.methods.swag.state.member_batchnorm`). Export materialises exactly
those N state dicts into N copies of the unwrapped network, stacked as ``x → [N, B, C]``:
the graph holds plain convs / matmuls (no sampling, no bayesify).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from bayesify.kit.stacked import StackedModels
from bayesify.methods.swag.posterior import base_parameter_name

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


@torch.no_grad()
def member_network(bnn: BayesianModel, state: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of the unwrapped network carrying ``state`` (sampled weights + BN statistics,
    keyed as functional_call keys of the wrapped model)."""
    net = bnn.unwrap().eval()
    targets = dict(net.named_parameters())
    targets.update(dict(net.named_buffers()))
    for key, value in state.items():
        target = targets[base_parameter_name(key)]
        target.copy_(value.to(target.device, target.dtype))
    return net


def export_swag(bnn: BayesianModel, states: list[dict[str, torch.Tensor]]) -> nn.Module:
    """``x → [N, B, C]``: one plain network per member state (θ̄ alone for 'swa' /
    deterministic / unfitted)."""
    return StackedModels([member_network(bnn, s) for s in states])
