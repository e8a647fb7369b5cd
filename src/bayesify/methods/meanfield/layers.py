"""Mean-field Gaussian posterior over the weights and bias of a Linear/Conv.

``w = μ + softplus(ρ) ∘ ε``, ``ε ~ N(0, I)`` (Bayes by Backprop). μ starts at the
pretrained weights and ``softplus(ρ) = δ·max(|w|, floor)``, so fine-tuning starts
at the pretrained network. The base layer's own tensors are never used in the
forward pass (they only centre the ``pretrained`` prior); μ and ρ are the
posterior parameters. Three estimators of the forward pass:

* local reparameterisation (Kingma et al. 2015): the pre-activation of row r is
  ``N(x_r μᵀ + b_μ, x_r² σ²ᵀ + σ_b²)``, sampled with per-row noise from
  ``context.draw`` (exact per-unit marginals; independent over conv pixels);
* flipout (Wen et al. 2018): ``x μᵀ + ((x ∘ s_in) ΔWᵀ + Δb) ∘ s_out`` with one
  ``ΔW = σ ∘ ε`` per forward and random signs ``s`` per row;
* weights: one full weight sample per member, evaluated batched.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer, broadcast_rows, channel_axis
from bayesify.kit.gaussian import inverse_softplus
from bayesify.kit.knobs import times_knob
from bayesify.kit.priors import WeightPrior
from bayesify.kit.weightspace import (
    apply_layer,
    batched_apply,
    has_own_forward,
    member_normal,
    member_rows,
)
from bayesify.methods.meanfield.config import MeanFieldConfig

logger = logging.getLogger(__name__)

#: keeps sqrt(var) differentiable where an input row is exactly zero (ReLU, padding)
_VAR_EPS = 1e-16


class MeanFieldLayer(BayesianLayer):
    """Wraps a Linear/Conv1d/2d/3d with a factorised Gaussian weight posterior.

    Parameters: ``weight_mu``, ``weight_rho`` (shape of the weight) and, when the
    base layer has a bias, ``bias_mu``, ``bias_rho`` ``[out]``.
    """

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: MeanFieldConfig) -> None:
        super().__init__(base_layer, context)
        self.sampling = config.sampling
        self.predict_sampling = config.predict_sampling
        if self.predict_sampling == "auto":
            self.predict_sampling = "local_reparam" if self.sampling == "local_reparam" else "weights"
        self.prior = WeightPrior.from_config(config)
        self.axis = channel_axis(base_layer)
        #: a layer whose forward transforms its weight (standardisation, same padding):
        #: local reparameterisation and flipout assume the plain operation, so its
        #: members' weights are sampled and go through that forward
        self.own_forward = has_own_forward(base_layer)
        if self.own_forward and self.sampling != "weights":
            logger.debug("meanfield: %s has its own forward (it transforms its weight): sampled "
                        "weights, not %s, on this layer", type(base_layer).__name__, self.sampling)
        weight = base_layer.weight.detach()
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        w = weight.to(dtype)
        self.weight_mu = nn.Parameter(w.clone())
        self.weight_rho = nn.Parameter(inverse_softplus(config.delta * w.abs().clamp_min(config.init_floor)))
        bias = getattr(base_layer, "bias", None)
        if bias is not None and config.bias:
            b = bias.detach().to(dtype)
            self.bias_mu = nn.Parameter(b.clone())
            self.bias_rho = nn.Parameter(inverse_softplus(config.delta * b.abs().clamp_min(config.init_floor)))
        else:
            self.bias_mu = None
            self.bias_rho = None

    # -- posterior -------------------------------------------------------------------
    @property
    def weight_std(self) -> torch.Tensor:
        """σ of the weights: softplus(ρ), times the validation-tuned
        ``meanfield_std_scale`` at prediction (1 in training and in the KL)."""
        return times_knob(F.softplus(self.weight_rho), self)

    @property
    def bias_std(self) -> torch.Tensor | None:
        return None if self.bias_rho is None else times_knob(F.softplus(self.bias_rho), self)

    def _fixed_bias(self) -> torch.Tensor | None:
        """The base bias when it carries no posterior (``bias=False``), else None."""
        if self.bias_mu is not None:
            return None
        return getattr(self.base_layer, "bias", None)

    def _mean_bias(self) -> torch.Tensor | None:
        return self.bias_mu if self.bias_mu is not None else self._fixed_bias()

    def mean_weight(self, name: str) -> torch.Tensor | None:
        """μ of the Gaussian posterior (the base tensor where it is not variational)."""
        mu = self._parameters.get(f"{name}_mu")
        return mu if mu is not None else getattr(self.base_layer, name)

    def num_nodes(self) -> int:
        """Random variables of the posterior: every weight and bias."""
        return self.weight_mu.numel() + (0 if self.bias_mu is None else self.bias_mu.numel())

    def kl(self) -> torch.Tensor:
        """``KL(q‖p)`` summed over every weight and bias of the layer (not divided by N)."""
        total = self.prior.kl(self.weight_mu.float(), F.softplus(self.weight_rho).float(),
                              self.base_layer.weight.detach().float())
        if self.bias_mu is not None:
            total = total + self.prior.kl(self.bias_mu.float(), F.softplus(self.bias_rho).float(),
                                          self.base_layer.bias.detach().float())
        return total

    # -- forward ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context.deterministic:
            return apply_layer(self.base_layer, x, self.weight_mu.to(x.dtype), _cast(self._mean_bias(), x))
        mode = self.sampling if self.training else self.predict_sampling
        if mode != "weights" and self.own_forward:
            mode = "weights"  # its forward transforms the weight: sampled weights go through it
        if mode == "local_reparam":
            return self.local_reparam_forward(x)
        if mode == "flipout":
            return self.flipout_forward(x)
        return self.weight_sample_forward(x)

    def local_reparam_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``mean + sqrt(var) ∘ ε`` with ``mean = op(x, μ, b_μ)``, ``var = op(x², σ², σ_b²)``.

        ε ``[R, *out_shape]`` comes from ``context.draw``: per row in training,
        per member at prediction.
        """
        mean = apply_layer(self.base_layer, x, self.weight_mu.to(x.dtype), _cast(self._mean_bias(), x))
        bias_var = None if self.bias_std is None else self.bias_std.pow(2).to(x.dtype)
        var = apply_layer(self.base_layer, x * x, self.weight_std.pow(2).to(x.dtype), bias_var)
        eps = self.context.draw(self.layer_id, x.shape[0], tuple(mean.shape[1:]), x.device)
        return mean + torch.sqrt(var + _VAR_EPS) * eps.to(x.dtype)

    def flipout_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``op(x, μ, b_μ) + (op(x ∘ s_in, ΔW) + Δb) ∘ s_out``, ``ΔW = σ ∘ ε`` shared by the batch."""
        rows, c_in, c_out = x.shape[0], self.weight_mu.shape[1] * self.base_layer_groups(), self.weight_mu.shape[0]
        mean = apply_layer(self.base_layer, x, self.weight_mu.to(x.dtype), _cast(self._mean_bias(), x))
        signs = self.context.draw(self.layer_id, rows, (c_in + c_out,), x.device, uniform=True)
        signs = (signs < 0.5).to(x.dtype) * 2.0 - 1.0
        s_in, s_out = signs[:, :c_in], signs[:, c_in:]
        generator = self.context.plan.generator
        delta_w = self.weight_std * torch.randn(self.weight_mu.shape, device=x.device, generator=generator)
        perturbed = apply_layer(self.base_layer, x * broadcast_rows(s_in, x, self.axis), delta_w.to(x.dtype), None)
        if self.bias_std is not None:
            delta_b = self.bias_std * torch.randn(self.bias_std.shape, device=x.device, generator=generator)
            perturbed = perturbed + _bias_view(delta_b.to(x.dtype), perturbed, self.axis)
        return mean + perturbed * broadcast_rows(s_out, perturbed, self.axis)

    def sample_member_weights(
        self, ids: torch.Tensor, num_members: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``weights [k, *w.shape]``, ``biases [k, out]`` (or None) of the members ``ids``."""
        n_w = self.weight_mu.numel()
        n_b = 0 if self.bias_mu is None else self.bias_mu.numel()
        eps = member_normal(self.context, self.layer_id, ids, num_members, n_w + n_b, device)
        k = ids.shape[0]
        dtype = self.weight_mu.dtype
        weights = self.weight_mu + self.weight_std * eps[:, :n_w].view(k, *self.weight_mu.shape).to(dtype)
        if self.bias_mu is not None:
            return weights, self.bias_mu + self.bias_std * eps[:, n_w:].to(dtype)
        fixed = self._fixed_bias()
        return weights, None if fixed is None else fixed.detach().expand(k, -1)

    def weight_sample_forward(self, x: torch.Tensor) -> torch.Tensor:
        """One weight sample per member present in the batch (one per forward without a plan)."""
        ids, row_member, num_members = member_rows(self.context, x.shape[0], x.device)
        weights, biases = self.sample_member_weights(ids, num_members, x.device)
        return batched_apply(self.base_layer, x, weights, biases, row_member)

    def member_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` of the single member of the active plan (for export)."""
        if self.context.deterministic:
            return self.weight_mu, self._mean_bias()
        ids, _, num_members = member_rows(self.context, 1, self.weight_mu.device)
        weights, biases = self.sample_member_weights(ids, num_members, self.weight_mu.device)
        return weights[0], None if biases is None else biases[0]

    def base_layer_groups(self) -> int:
        return int(getattr(self.base_layer, "groups", 1))

    def extra_repr(self) -> str:
        return (f"weights={self.weight_mu.numel()}, bias={self.bias_mu is not None}, "
                f"sampling={self.sampling}, prior={self.prior.kind}")


def _cast(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.to(x.dtype)


def _bias_view(b: torch.Tensor, y: torch.Tensor, axis: int) -> torch.Tensor:
    """``[C_out]`` → broadcastable against ``y`` along its channel axis."""
    if axis == 1:
        return b.view(1, -1, *([1] * (y.dim() - 2)))
    return b
