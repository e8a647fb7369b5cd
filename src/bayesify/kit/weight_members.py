"""Export of weight-space posteriors: M plain networks with frozen weight samples.

At prediction member ``m`` of a weight-space family is a network with its own
weights (meanfield ``predict_sampling='weights'``, every hypernet). Exporting
therefore materialises those M weight sets — drawn with the predictor's seed
exactly as ``member_logits`` draws them — into M copies of the unwrapped base
network, stacked as ``x → [M, B, C]``. The exported graph holds plain convs
and matmuls only (no random ops, no bayesify).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.layers import find_batch_free
from bayesify.core.method import member_components
from bayesify.kit.stacked import StackedModels

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def export_weight_members(
    bnn: BayesianModel, *, samples_per_component: int, seed: int, example_input: Any
) -> nn.Module:
    """``x → [M, B, C]`` from M unwrapped copies carrying member m's weights.

    Every injected layer must implement ``member_parameters() -> (weight, bias)``
    for the single member of the active plan.
    """
    device = example_input.device
    num_members = member_components(bnn.method.components, samples_per_component).shape[0]
    shared = find_batch_free(bnn, example_input)
    layers = {name: layer for name, layer in bnn.bayesian_layers().items() if name not in shared}
    models = []
    for m in range(num_members):
        member = torch.tensor([m], device=device)
        with torch.no_grad(), bnn.context.use(
            torch.zeros(1, dtype=torch.long, device=device), member=member,
            num_members=num_members, seed=seed,
        ):
            params = {name: layer.member_parameters() for name, layer in layers.items()}
        net = bnn.unwrap().eval()
        with torch.no_grad():
            for name, (weight, bias) in params.items():
                module = net.get_submodule(name)
                module.weight.copy_(weight.to(module.weight.dtype))
                if bias is not None:
                    module.bias.copy_(bias.to(module.bias.dtype))
        models.append(net)
    return StackedModels(models)
