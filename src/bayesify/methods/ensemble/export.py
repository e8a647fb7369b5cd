"""Export of deep / snapshot ensembles: one plain network per member, stacked.

In process every EnsembleLayer routes rows to its member's weight copy with
``bincount(...).tolist()`` (data-dependent, so torch.export cannot trace it). The
members are deterministic networks, so export materialises component ``k`` as a copy
of the unwrapped network whose Conv/Linear carry ``member_weight[k], member_bias[k]``
and whose BatchNorms (``per_member_bn``) carry member k's ``γ, β`` and running
statistics; predictive member ``m`` is component ``member_components[m]``::

    x [B, ...] → stack_k f_k(x) [K, B, C] → index_select(member_components) [M, B, C]

Training is unchanged (the routing layer is not touched).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.layers import find_batch_free
from bayesify.core.method import member_components
from bayesify.core.outputs import logits_of
from bayesify.errors import BayesifyError
from bayesify.kit.member_bn import MemberBatchNorm
from bayesify.methods.ensemble.layers import EnsembleLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


class ComponentStack(nn.Module):
    """``x → [M, B, C]`` from K plain networks and the component of every member."""

    def __init__(self, models: list[nn.Module], member_components: torch.Tensor) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)
        self.register_buffer("member_components", member_components.clone())

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = torch.stack([logits_of(m(*args, **kwargs)).float() for m in self.models])
        return logits.index_select(0, self.member_components)


@torch.no_grad()
def component_network(bnn: BayesianModel, k: int, shared: Iterable[str] = ()) -> nn.Module:
    """A copy of the unwrapped network that computes ensemble member ``k`` alone; the layers
    named in ``shared`` (:func:`~bayesify.core.layers.find_batch_free`) keep the network's
    weights, as they do in process."""
    net = bnn.unwrap().eval()
    for name, layer in bnn.bayesian_layers().items():
        if name in shared:
            continue
        module = net.get_submodule(name) if name else net
        if isinstance(layer, EnsembleLayer):
            module.weight.copy_(layer.member_weight[k].to(module.weight.dtype))
            if layer.member_bias is not None:
                module.bias.copy_(layer.member_bias[k].to(module.bias.dtype))
        elif isinstance(layer, MemberBatchNorm):
            # eval BN = (x − μ_k)/sqrt(σ²_k + eps)·γ_k + β_k, exactly MemberBatchNorm's eval map
            dtype = module.running_mean.dtype if module.running_mean is not None else torch.float32
            if not module.affine:  # member γ, β are trainable even when the base BN had none
                module.affine = True
                module.weight = nn.Parameter(torch.empty_like(layer.member_weight[k], dtype=dtype))
                module.bias = nn.Parameter(torch.empty_like(layer.member_bias[k], dtype=dtype))
            module.weight.copy_(layer.member_weight[k].to(module.weight.dtype))
            module.bias.copy_(layer.member_bias[k].to(module.bias.dtype))
            if module.running_mean is None:
                raise BayesifyError(
                    f"cannot export ensemble member BatchNorm {name!r}: it keeps no running "
                    "statistics (track_running_stats=False)"
                )
            module.running_mean.copy_(layer.member_running_mean[k])
            module.running_var.copy_(layer.member_running_var[k])
        else:
            raise BayesifyError(
                f"cannot export ensemble layer {name!r} of type {type(layer).__name__}; "
                "only EnsembleLayer and MemberBatchNorm are known"
            )
    return net


def export_ensemble(bnn: BayesianModel, *, samples_per_component: int,
                    example_input: Any) -> nn.Module:
    """``x → [M, B, C]``: K member networks, member m = component ``member_components[m]``."""
    components = bnn.method.components
    members = member_components(components, samples_per_component, example_input.device)
    shared = find_batch_free(bnn, example_input)
    models = [component_network(bnn, k, shared) for k in range(components)]
    return ComponentStack(models, members)
