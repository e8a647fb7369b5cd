"""Multiplicative node noise before a Conv/Linear layer.

``f_l = σ(U_l (z_l ∘ f_{l-1}) + b_l)`` with ``z_l ~ q(z_l)``, a mixture of K
diagonal Gaussians over the input channels. Equivalent to the stochastic weight
``W = U diag(z)``; the noise of a row is shared over pixels (conv) and tokens
(linear on ``[B, N, C]``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import (
    BayesianLayer,
    broadcast_rows,
    channel_axis,
    concatenated_kl,
    in_channels,
)
from bayesify.kit.gaussian import gaussian_kl, inverse_softplus
from bayesify.kit.knobs import times_knob
from bayesify.methods.ibnn.config import IBNNConfig


class NodeNoiseLayer(BayesianLayer):
    """Wraps a Linear/Conv: multiplies its input by per-row, per-channel noise.

    Parameters: ``mean [K, C]`` and ``rho [K, C]`` with std = softplus(ρ).
    """

    runs_base_hooks = True  # calls the original layer

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: IBNNConfig) -> None:
        super().__init__(base_layer, context)
        k, c = config.components, in_channels(base_layer)
        self.axis = channel_axis(base_layer)
        self.prior_mean = config.prior_mean
        self.prior_std = config.prior_std
        self.entropy_weight = config.entropy_weight
        weight = base_layer.weight
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        factory = {"device": weight.device, "dtype": dtype}
        mean = torch.full((k, c), config.init_mean, **factory)
        if config.init_mean_std > 0:
            mean = mean + config.init_mean_std * torch.randn(k, c, **factory)
        std0 = (config.init_std[0] + config.init_std[1] * torch.randn(k, c, **factory)).abs()
        self.mean = nn.Parameter(mean)
        self.rho = nn.Parameter(inverse_softplus(std0, floor=1e-8), requires_grad=config.learn_std)

    @property
    def std(self) -> torch.Tensor:
        return F.softplus(self.rho)

    def num_nodes(self) -> int:
        return self.mean.shape[1]

    def sample_noise(self, rows: int, device: torch.device) -> torch.Tensor:
        """``[R, C]`` noise: z = μ_k + c·σ_k ε for the component k of every row (fp32);
        ``c`` is the validation-tuned ``ibnn_noise_scale`` (1 in training)."""
        comp = self.context.components_for(rows, device)
        mean = self.mean.index_select(0, comp)
        if self.context.deterministic:
            return mean
        eps = self.context.draw(self.layer_id, rows, (mean.shape[1],), device)
        return mean + times_knob(self.std, self).index_select(0, comp) * eps

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        z = self.sample_noise(x.shape[0], x.device)
        return self.base_layer(x * broadcast_rows(z, x, self.axis).to(x.dtype), *args, **kwargs)

    def kl(self) -> torch.Tensor:
        """KL of the averaged component q̂ = N(mean_k μ_k, Σ_k σ_k² / K²) to the prior,
        minus γ·H[q̂] with γ = ``entropy_weight`` (Trinh et al. 2022; 0: the ELBO's KL).

        Paper eq. 22–24: the distribution of the average of one sample per
        component; summed over nodes.
        """
        return self._kl(self.mean, self.rho)

    def _kl(self, mean: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        k = mean.shape[0]
        mu_hat = mean.float().mean(0)
        var_hat = F.softplus(rho.float()).pow(2).sum(0) / k**2
        kl = gaussian_kl(mu_hat, var_hat, self.prior_mean, self.prior_std).sum()
        if self.entropy_weight:
            entropy = 0.5 * (var_hat * (2 * math.pi * math.e)).log().sum()
            kl = kl - self.entropy_weight * entropy
        return kl

    @staticmethod
    def kl_many(layers: list[NodeNoiseLayer]) -> torch.Tensor:
        """Σ :meth:`kl` over ``layers`` as one computation on the concatenated nodes."""
        return concatenated_kl(
            layers, key=lambda lay: (lay.mean.shape[0], lay.prior_mean, lay.prior_std,
                                     lay.entropy_weight, lay.mean.device),
            parts=lambda lay: ([lay.mean], [lay.rho]), kl=NodeNoiseLayer._kl)

    def extra_repr(self) -> str:
        k, c = self.mean.shape
        return f"components={k}, nodes={c}, axis={self.axis}"
