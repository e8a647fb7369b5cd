"""MC-dropout layer: Bernoulli masks on the input of a Linear/Conv, active at prediction.

``out = (x ∘ m / (1 − p)) M + b`` with ``m ~ Bernoulli(1 − p)`` per row (per
member at prediction, so each member is one fixed thinned network). Equivalent to
the variational distribution ``W = diag(m) M`` of Gal & Ghahramani (2016); ``M``
is a trainable copy of the pretrained weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer, broadcast_rows, channel_axis, in_channels
from bayesify.kit.knobs import knob_float
from bayesify.kit.rank_one import forward_without_bias
from bayesify.methods.dropout.config import DropoutConfig


class DropoutLayer(BayesianLayer):
    """Dropout before ``base_layer``; ``variational_weight``/``variational_bias`` are the trainable M, m."""

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: DropoutConfig) -> None:
        super().__init__(base_layer, context)
        if isinstance(base_layer, nn.modules.conv._ConvTransposeNd):
            raise TypeError("dropout layers wrap Linear and Conv1d/2d/3d, not ConvTranspose")
        self.p = float(config.p)
        self.granularity = config.granularity
        self.axis = channel_axis(base_layer)
        self.channels = in_channels(base_layer)
        self.train_weights = bool(config.train_weights)
        if self.train_weights:
            # M and m of q(W): a trainable copy; the base layer keeps the pretrained values
            self.variational_weight = nn.Parameter(base_layer.weight.detach().clone())
            if base_layer.bias is not None:
                self.variational_bias = nn.Parameter(base_layer.bias.detach().clone())

    def mean_weight(self, name: str) -> torch.Tensor | None:
        """Inverted dropout keeps the mean: the (fine-tuned or base) weights themselves."""
        own = self._parameters.get(f"variational_{name}")
        return own if own is not None else getattr(self.base_layer, name)

    def num_nodes(self) -> int:
        return self.channels

    def rate(self) -> float:
        """The dropout rate in use: ``p`` in training, ``min(p·c, 0.9)`` at prediction with
        ``c`` the validation-tuned ``dropout_rate_scale`` (0 = no dropout)."""
        return min(self.p * knob_float(self), 0.9)

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        """``x ∘ m / (1 − p)``; masks per row (training) or per member (prediction)."""
        p = self.rate()
        if p == 0.0 or self.context.deterministic:
            return x
        plan = self.context.plan
        keep = 1.0 - p

        def mask(u: torch.Tensor) -> torch.Tensor:  # per member before the rows' gather
            return (u >= p).to(x.dtype) / keep

        if self.granularity == "element":
            if plan.member is None and plan.generator is None:
                return F.dropout(x, p, training=True)  # fused per-row masks
            return x * self.context.draw(self.layer_id, x.shape[0], tuple(x.shape[1:]),
                                         x.device, uniform=True, then=mask)
        masks = self.context.draw(self.layer_id, x.shape[0], (self.channels,), x.device,
                                  uniform=True, then=mask)
        return x * broadcast_rows(masks, x, self.axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(x)
        if not self.train_weights:
            return self.base_layer(x)
        out = forward_without_bias(self.base_layer, x, self.variational_weight)
        if self.base_layer.bias is None:
            return out
        shape = [1] * out.dim()
        shape[self.axis] = self.variational_bias.shape[0]
        return out + self.variational_bias.view(shape)

    def extra_repr(self) -> str:
        return f"p={self.p}, granularity={self.granularity}, train_weights={self.train_weights}"
