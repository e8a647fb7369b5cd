"""Ensemble layer: M independent weight copies of a Linear/Conv, rows routed by member.

Row r of the (tiled) batch is computed by member ``comp[r]``:
``out_r = x_r W_comp[r] + b_comp[r]``. Training tiles the batch M times, so each
member's copy receives exactly the gradient of its own mean loss (scaled by 1/M).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer, channel_axis, in_channels
from bayesify.kit.rank_one import forward_without_bias
from bayesify.methods.ensemble.config import EnsembleConfig


class EnsembleLayer(BayesianLayer):
    """``member_weight [M, *W.shape]`` and ``member_bias [M, C_out]`` copied from the base layer."""

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: EnsembleConfig) -> None:
        super().__init__(base_layer, context)
        if isinstance(base_layer, nn.modules.conv._ConvTransposeNd):
            raise TypeError("ensemble layers wrap Linear and Conv1d/2d/3d, not ConvTranspose")
        m = config.components
        self.axis = channel_axis(base_layer)
        weight = base_layer.weight.detach()
        copies = weight.unsqueeze(0).repeat(m, *([1] * weight.dim())).clone()
        if config.init_noise > 0:
            gen = torch.Generator(device=weight.device).manual_seed(config.seed + 7919 * self.layer_id)
            jitter = torch.randn(copies.shape, generator=gen, device=weight.device, dtype=copies.dtype)
            copies = copies * (1 + config.init_noise * jitter)
        self.member_weight = nn.Parameter(copies)
        bias = base_layer.bias
        self.member_bias = (
            nn.Parameter(bias.detach().unsqueeze(0).repeat(m, 1).clone()) if bias is not None else None
        )

    def num_nodes(self) -> int:
        return in_channels(self.base_layer)

    @torch.no_grad()
    def reset_member(self, k: int, generator: torch.Generator) -> None:
        """Re-initialise member ``k`` like a fresh torch layer: U(±1/sqrt(fan_in))."""
        weight = self.member_weight[k]
        bound = 1.0 / math.sqrt(max(1, weight[0].numel()))
        weight.copy_((torch.rand(weight.shape, generator=generator) * 2 - 1) * bound)
        if self.member_bias is not None:
            bias = self.member_bias[k]
            bias.copy_((torch.rand(bias.shape, generator=generator) * 2 - 1) * bound)

    @torch.no_grad()
    def copy_member(self, source: int, target: int) -> None:
        self.member_weight[target].copy_(self.member_weight[source])
        if self.member_bias is not None:
            self.member_bias[target].copy_(self.member_bias[source])

    def _member_forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
        out = forward_without_bias(self.base_layer, x, self.member_weight[k].to(x.dtype))
        if self.member_bias is None:
            return out
        shape = [1] * out.dim()
        shape[self.axis] = self.member_bias.shape[1]
        return out + self.member_bias[k].view(shape).to(out.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comp = self.context.components_for(x.shape[0], x.device)
        counts = torch.bincount(comp, minlength=self.member_weight.shape[0]).tolist()
        if bool((comp[1:] >= comp[:-1]).all()):
            # contiguous member blocks (tiled training and prediction): plain slices
            pieces = [
                self._member_forward(chunk, k)
                for k, chunk in enumerate(x.split(counts, 0)) if counts[k] > 0
            ]
            return torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
        order = torch.argsort(comp, stable=True)
        pieces = [
            self._member_forward(chunk, k)
            for k, chunk in enumerate(x.index_select(0, order).split(counts, 0)) if counts[k] > 0
        ]
        return torch.cat(pieces, 0).index_select(0, torch.argsort(order))

    def extra_repr(self) -> str:
        return f"members={self.member_weight.shape[0]}, weight={tuple(self.member_weight.shape[1:])}"
