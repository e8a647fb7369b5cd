"""MNF around a Linear/Conv: multiplicative node noise with a flow posterior and a
Gaussian weight posterior given the noise (Louizos & Welling 2017).

Per wrapped layer with C input nodes (features; channels of a conv, shared over pixels;
of a linear on ``[B, N, C]``, shared over tokens) and base weights ``w`` (kept as the
mean: frozen, or fine-tuned as a point estimate with ``base_lr > 0`` like iBNN's)::

    z_0 ~ N(μ_z, diag σ_z²),   z = f_T ∘ … ∘ f_1(z_0)                       [R, C]
    q(W | z) = Π_ij N(z_i w_ij, σ_ij²)

With the local reparameterisation (as in the paper) the pre-activation of row r is
Gaussian given z_r, so only activations are sampled::

    mean = op(x ∘ z, w) + b            (= the base layer on the rescaled input)
    var  = op(x², σ²)                  (conv: the same convolution of x² with σ²)
    out  = mean + √var ∘ ε,            ε ~ N(0, I) per row and output unit

Noise: z_0's ε from ``context.draw(layer_id, …)`` and the pre-activation ε from a second
stream ``noise_id``, so training, prediction (fixed per member) and export (frozen
tables) see the same members. ``weight_std = 0`` drops σ (no ε), and at flow depth 0 the
layer is exactly iBNN's :class:`~bayesify.methods.ibnn.layers.NodeNoiseLayer` with K = 1.
The tuned ``mnf_noise_scale`` multiplies σ_z and σ at prediction (0: the mean network
``op(x ∘ f(μ_z), w) + b``, which is also what ``deterministic()`` runs).
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer, broadcast_rows, channel_axis, in_channels
from bayesify.kit.gaussian import gaussian_kl, inverse_softplus
from bayesify.kit.knobs import times_knob
from bayesify.kit.weightspace import apply_layer, has_own_forward
from bayesify.methods.mnf.bound import InverseModel, node_prior_kl, node_view
from bayesify.methods.mnf.config import MNFConfig
from bayesify.methods.mnf.flows import CouplingFlow

#: keeps sqrt(var) differentiable where an input row is exactly zero (ReLU, padding)
_VAR_EPS = 1e-16
logger = logging.getLogger(__name__)

_HALF_LOG_2PI_E = 0.5 * (1.0 + math.log(2.0 * math.pi))


def _fp32(z: torch.Tensor):
    """Autocast off around the flow: bf16 would round z ≈ 1 ± 0.05 to steps of 0.004."""
    if torch.is_autocast_enabled(z.device.type):
        return torch.autocast(device_type=z.device.type, enabled=False)
    return nullcontext()


class MNFLayer(BayesianLayer):
    """Wraps a Linear/Conv1d/2d/3d with the MNF posterior.

    Parameters: ``z_mean``, ``z_rho`` ``[C]`` (q(z_0), σ_z = softplus(ρ)), ``flow``
    (q's coupling flow), and with ``weight_std > 0`` ``weight_rho`` (shape of the
    weight, σ = softplus(ρ)) and ``inverse`` (the auxiliary r, training only).
    """

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: MNFConfig) -> None:
        super().__init__(base_layer, context)
        self.noise_id = context.next_layer_id()  # the pre-activation noise's own stream
        c = in_channels(base_layer)
        self.axis = channel_axis(base_layer)
        self.groups = int(getattr(base_layer, "groups", 1))
        self.prior_std = config.prior_std
        self.prior_weight_std = config.prior_weight_std
        self.floor = config.init_floor
        self.kl_samples = config.kl_samples
        weight = base_layer.weight.detach()
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        factory = {"device": weight.device, "dtype": dtype}
        self.z_mean = nn.Parameter(torch.ones(c, **factory))
        self.z_rho = nn.Parameter(inverse_softplus(torch.full((c,), config.init_std, **factory)),
                                  requires_grad=config.learn_std)
        self.flow = CouplingFlow(c, depth=config.flow_depth, hidden=config.flow_hidden,
                                 scale=config.init_std).to(**factory)
        own = has_own_forward(base_layer)
        if own and config.weight_std > 0:
            # its forward transforms the weight (standardisation, same padding): the local
            # reparameterisation of the weight noise assumes the plain operation, so the
            # layer keeps its node noise z alone (exact through that forward, and exported)
            logger.debug("mnf: %s has its own forward (it transforms its weight): node noise "
                        "only on this layer (no weight noise)", type(base_layer).__name__)
        if config.weight_std > 0 and not own:
            std0 = config.weight_std * weight.to(dtype).abs().clamp_min(config.init_floor)
            self.weight_rho = nn.Parameter(inverse_softplus(std0), requires_grad=config.learn_std)
            self.inverse = InverseModel(c, depth=config.inverse_flow_depth,
                                        hidden=2 * config.flow_hidden, init_std=config.init_std,
                                        use_nodes=config.inverse_model == "node").to(**factory)
        else:
            self.weight_rho = None
            self.inverse = None

    # -- posterior -----------------------------------------------------------------------
    @property
    def z_std(self) -> torch.Tensor:
        """σ_z ``[C]`` of q(z_0) (the tuned knob is applied in :meth:`node_noise`)."""
        return F.softplus(self.z_rho)

    @property
    def weight_sigma(self) -> torch.Tensor | None:
        """σ of q(W | z) (shape of the weight), or None without weight noise."""
        return None if self.weight_rho is None else F.softplus(self.weight_rho)

    def num_nodes(self) -> int:
        """Random variables per member: the C node scales, plus every weight with σ > 0."""
        extra = 0 if self.weight_rho is None else self.weight_rho.numel()
        return self.z_mean.shape[0] + extra

    def node_noise(self, rows: int, device: torch.device) -> torch.Tensor:
        """``z [R, C]`` (fp32): ``f(μ_z + c·σ_z ∘ ε)`` per row (per member at prediction),
        ``c`` the tuned ``mnf_noise_scale`` (1 in training); ``f(μ_z)`` when deterministic."""
        with _fp32(self.z_mean):
            if self.context.deterministic:
                return self.flow(self.z_mean.unsqueeze(0))[0].expand(rows, -1)
            eps = self.context.draw(self.layer_id, rows, (self.z_mean.shape[0],), device)
            eps = eps.to(self.z_mean.dtype)  # drawn in fp32; bf16 after bnn.to(torch.bfloat16)
            z0 = self.z_mean + times_knob(self.z_std, self) * eps
            return self.flow(z0)[0]

    # -- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.node_noise(x.shape[0], x.device)
        scaled = x * broadcast_rows(z, x, self.axis).to(x.dtype)
        if self.weight_rho is None or self.context.deterministic:
            return self.base_layer(scaled)
        sigma = times_knob(self.weight_sigma, self)
        mean = self.base_layer(scaled)
        var = apply_layer(self.base_layer, x * x, sigma.pow(2).to(x.dtype), None)
        eps = self.context.draw(self.noise_id, x.shape[0], tuple(mean.shape[1:]), x.device)
        return mean + torch.sqrt(var + _VAR_EPS) * eps.to(x.dtype)

    # -- the KL part of the bound ----------------------------------------------------------
    def kl_sample(self, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``z_T ~ q(z_T)`` ``[K, C]`` and ``log q(z_T)`` ``[K]``, with ``log q(z_0)`` replaced by
        its expectation ``−Σ (log σ_z + ½ log 2πe)`` (the closed-form entropy)."""
        # in the posterior's own dtype (float32, or float64 for a float64 network: the flow's)
        eps = torch.randn((samples, self.z_mean.shape[0]), device=self.z_mean.device,
                          dtype=self.z_mean.dtype)
        std = self.z_std
        z, logdet = self.flow(self.z_mean + std * eps)
        return z, -(torch.log(std) + _HALF_LOG_2PI_E).sum() - logdet

    def kl(self) -> torch.Tensor:
        """The layer's KL term of the auxiliary bound (Monte Carlo over ``kl_samples`` z_T, fp32).

        ``weight_std > 0``: ``KL(q(W|z_T)‖p(W)) + log q(z_T) − E log r(z_T|W)`` (see
        :mod:`bayesify.methods.mnf.bound`). ``weight_std = 0``: ``KL(q(z_T) ‖ N(1, s²))``
        — closed form at flow depth 0 (iBNN's with K = 1), else ``log q(z_T) − log p(z_T)``.
        """
        if self.weight_rho is None and not self.flow.layers:
            return gaussian_kl(self.z_mean.float(), self.z_std.float().pow(2), 1.0,
                               self.prior_std).sum()
        z, log_q = self.kl_sample(self.kl_samples)
        if self.weight_rho is None:
            log_p = (-0.5 * ((z - 1.0) / self.prior_std).pow(2) - math.log(self.prior_std)
                     - 0.5 * math.log(2.0 * math.pi)).sum(-1)
            return (log_q - log_p).mean()
        w = node_view(self.base_layer.weight.detach().to(z.dtype), self.groups)
        sigma = node_view(self.weight_sigma.to(z.dtype), self.groups)
        kl_w = node_prior_kl(w, sigma, z, scale=self.prior_std, jitter=self.prior_weight_std,
                             floor=self.floor)
        if self.inverse.use_nodes:
            neg_log_r = self.inverse.neg_log_prob(z, w, sigma.pow(2))
        else:  # eq. 11–12 need a whole W ~ q(W|z_T): one, for the first z sample
            weights = z[0].unsqueeze(1) * w + sigma * torch.randn_like(w)
            neg_log_r = self.inverse.neg_log_prob(z[:1], w, sigma.pow(2), weights)
        return (kl_w + log_q).mean() + neg_log_r.mean()

    def extra_repr(self) -> str:
        return (f"nodes={self.z_mean.shape[0]}, flow_depth={len(self.flow.layers)}, "
                f"weight_noise={self.weight_rho is not None}, axis={self.axis}")
