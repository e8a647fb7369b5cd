"""Bayesian normalisation layer (ABNN): ``y = γ_k·(x̂ ⊙ (1 + σ·ε)) + β_k``.

``x̂`` is the wrapped layer's normalisation without its affine part (BatchNorm with its
running statistics, LayerNorm over the features, GroupNorm over its groups), ``k`` the
member of the row, ``ε ~ N(0, 1)`` one value per row and channel (shared over pixels and
tokens, so the exported noise does not depend on the input size). ``γ_k, β_k [K, C]``
start at the pretrained affine parameters; with σ = 0 (or under ``deterministic()``)
the layer calls the same fused kernel as the wrapped layer, so the pretrained network is
reproduced bit for bit.

Which modules are wrapped is decided by what they compute, not by their class name: a
BatchNorm / LayerNorm / GroupNorm (or a subclass, e.g. timm's ``LayerNorm2d``) is a target
when its output on a probe input equals the plain normalisation over the channel axis 1
or the last axis (:func:`norm_axis`). A norm-activation layer — timm's ``BatchNormAct2d``
(EfficientNet, MobileNet, RegNet), ``GroupNormAct`` (BiT), ``LayerNormAct2d``,
``FrozenBatchNormAct2d``; Hugging Face BiT's ``BitGroupNormActivation`` — is a target when
its output equals that normalisation followed by its own ``drop`` and ``act``
(``activation``) modules, which this layer then applies after the members' affine
(:func:`~bayesify.kit.member_bn.batchnorm_epilogue`; until the thirty-seventh stop they
were refused, and ``abnn`` wrapped 16 of EfficientNet-Lite0's 49 BatchNorms); an
activation written into ``forward`` (no such module) is not a target. A
``FrozenBatchNorm2d`` (torchvision's, timm's: γ, β and the statistics as buffers) is a
target on the same test; its members' γ, β are parameters like any other's (σ = 0 gives
the network to float rounding there: its own formula is not the batch_norm kernel). An
RMS normalisation (``torch.nn.RMSNorm``; Llama's, Mistral's, Qwen's, T5's: :func:`rms_norm`)
is a target on the same test over the last axis; its members get a β too, starting at 0
(σ = 0 is the network to float rounding).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer, broadcast_rows
from bayesify.errors import BayesifyError
from bayesify.kit.knobs import knob_value
from bayesify.kit.member_bn import batchnorm_epilogue
from bayesify.methods.abnn.config import ABNNConfig

NORM_TYPES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm,
                                           nn.GroupNorm)


def frozen_batchnorm(module: nn.Module) -> bool:
    """A ``FrozenBatchNorm2d`` (torchvision's detection backbones, timm's
    ``freeze_batch_norm_2d``): BatchNorm in eval mode whose γ, β and statistics are buffers.
    :func:`norm_axis` still checks that it computes the plain normalisation."""
    return (type(module).__name__ in ("FrozenBatchNorm2d", "FrozenBatchNormAct2d")
            and all(isinstance(getattr(module, name, None), torch.Tensor)
                    for name in ("weight", "bias", "running_mean", "running_var")))


def rms_norm(module: nn.Module) -> bool:
    """An RMS normalisation (``γ ⊙ x / sqrt(mean(x²) + ε)`` over the last axis, no mean, no
    β): ``torch.nn.RMSNorm`` and the transformer libraries' own (Llama, Mistral, Qwen,
    T5's ``T5LayerNorm``: ``weight`` and ``variance_epsilon``). :func:`norm_axis` checks that
    it computes that (Gemma's ``γ = 1 + weight`` does not, and is left alone)."""
    if isinstance(module, getattr(nn, "RMSNorm", ())):
        return module.normalized_shape is not None and len(module.normalized_shape) == 1
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    return (("RMSNorm" in name or name == "T5LayerNorm")
            and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and getattr(module, "bias", None) is None
            and isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)),
                           float))


def _rms_eps(module: nn.Module, x: torch.Tensor) -> float:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(torch.finfo(x.dtype).eps) if eps is None else float(eps)


def _channels(module: nn.Module) -> int:
    if frozen_batchnorm(module) or rms_norm(module):
        return int(module.weight.shape[0])
    if isinstance(module, nn.LayerNorm):
        return int(module.normalized_shape[0])
    if isinstance(module, nn.GroupNorm):
        return int(module.num_channels)
    return int(module.num_features)


def _probe_inputs(module: nn.Module) -> list[tuple[int, torch.Tensor]]:
    """``(axis, x)`` candidates: the channel axis and an input of the module's rank."""
    c = _channels(module)
    gen = torch.Generator().manual_seed(0)
    if rms_norm(module):
        return [(-1, torch.randn(2, 3, c, generator=gen))]
    if isinstance(module, nn.LayerNorm):
        return [(-1, torch.randn(2, 3, c, generator=gen)),
                (1, torch.randn(2, c, 3, 3, generator=gen))]
    if isinstance(module, nn.BatchNorm1d):
        return [(1, torch.randn(2, c, 3, generator=gen))]
    if isinstance(module, nn.BatchNorm3d):
        return [(1, torch.randn(2, c, 2, 2, 2, generator=gen))]
    return [(1, torch.randn(2, c, 3, 3, generator=gen))]


def _normalise(module: nn.Module, x: torch.Tensor, axis: int, weight: torch.Tensor | None,
               bias: torch.Tensor | None, *, training: bool = False) -> torch.Tensor:
    """The plain normalisation of ``module`` (affine ``weight``, ``bias`` or none) on ``x``
    with channels at ``axis`` (1 or −1)."""
    if rms_norm(module):  # the last axis; float32 statistics, as the libraries compute them
        if isinstance(module, getattr(nn, "RMSNorm", ())):
            out = F.rms_norm(x, module.normalized_shape, weight, module.eps)
        else:
            work = x.float()
            out = (work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + _rms_eps(module, x))
                   ).to(x.dtype)
            out = out if weight is None else weight * out
        return out if bias is None else out + bias
    if isinstance(module, nn.LayerNorm):
        if axis == -1:
            return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)
        moved = x.movedim(1, -1)
        return F.layer_norm(moved, module.normalized_shape, weight, bias, module.eps).movedim(-1, 1)
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(x, module.num_groups, weight, bias, module.eps)
    stats = module.running_mean is None or (training and not frozen_batchnorm(module))
    momentum = getattr(module, "momentum", None)
    return F.batch_norm(x, module.running_mean, module.running_var, weight, bias, stats,
                        0.1 if momentum is None else momentum, float(getattr(module, "eps", 1e-5)))


def norm_axis(module: nn.Module) -> int | None:
    """The channel axis (1 or −1) of a normalisation layer whose output is the plain
    normalisation with its affine parameters, else ``None`` (not a normalisation layer, a
    multi-dimensional LayerNorm shape, or a subclass computing something else)."""
    if not isinstance(module, NORM_TYPES) and not frozen_batchnorm(module) \
            and not rms_norm(module):
        return None
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
        return None
    probe = copy.deepcopy(module).float().eval().cpu()
    for axis, x in _probe_inputs(probe):
        try:
            with torch.no_grad():
                got = probe(x)
                want = batchnorm_epilogue(probe, _normalise(probe, x, axis, probe.weight,
                                                            getattr(probe, "bias", None)))
        except (RuntimeError, ValueError, IndexError, TypeError):
            continue
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(
                got, want, atol=1e-5, rtol=1e-5):
            return axis
    return None


class _NormProbe(type):
    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, nn.Module) and norm_axis(instance) is not None


class PlainNorm(metaclass=_NormProbe):
    """Wrapper-table key: a BatchNorm / LayerNorm / GroupNorm that computes the plain
    normalisation (``isinstance`` runs :func:`norm_axis`)."""

    #: how errors name the layers this key matches
    display_name = ("BatchNorm / LayerNorm / GroupNorm / FrozenBatchNorm2d / RMSNorm (the "
                    "plain normalisation, or followed by its own act module: timm's NormAct)")


class BayesNormLayer(BayesianLayer):
    """Wraps a normalisation layer; ``member_weight, member_bias [K, C]`` are the members' γ, β."""

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: ABNNConfig) -> None:
        super().__init__(base_layer, context)
        axis = norm_axis(base_layer)
        if axis is None:
            raise BayesifyError(
                f"abnn wraps BatchNorm / LayerNorm (one normalised dimension) / GroupNorm / RMSNorm layers "
                f"that compute the plain normalisation; {type(base_layer).__name__} does not")
        self.axis = axis
        c, k = _channels(base_layer), config.components
        ref = next(base_layer.parameters(), None)
        factory = {"device": ref.device if ref is not None else None, "dtype": torch.float32}
        weight = getattr(base_layer, "weight", None)
        bias = getattr(base_layer, "bias", None)
        weight = weight.detach().float() if weight is not None else torch.ones(c, **factory)
        bias = bias.detach().float() if bias is not None else torch.zeros(c, **factory)
        self.member_weight = nn.Parameter(weight.expand(k, c).clone())
        self.member_bias = nn.Parameter(bias.expand(k, c).clone())
        self.register_buffer("prior_weight", weight.clone())
        self.register_buffer("prior_bias", bias.clone())
        self.noise_std = float(config.noise_std)
        self.prior_std = float(config.prior_std)

    def num_nodes(self) -> int:
        return self.member_weight.shape[1]

    def _fused(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """The wrapped layer's own kernel with member ``k``'s γ, β."""
        return _normalise(self.base_layer, x, self.axis, self.member_weight[k].to(x.dtype),
                          self.member_bias[k].to(x.dtype), training=self.base_layer.training)

    def _affine(self, x: torch.Tensor, comp: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """``γ_r ⊙ x̂ ⊙ scale_r + β_r`` with per-row ``γ_r, β_r`` of the rows' members."""
        xhat = _normalise(self.base_layer, x, self.axis, None, None, training=self.base_layer.training)
        gamma = self.member_weight.index_select(0, comp)
        if scale is not None:
            gamma = gamma * scale
        beta = self.member_bias.index_select(0, comp)
        return torch.addcmul(broadcast_rows(beta, x, self.axis).to(x.dtype), xhat,
                             broadcast_rows(gamma, x, self.axis).to(x.dtype))

    def _mean_forward(self, x: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
        """No noise: the wrapped layer's fused kernel with each member's γ, β, selected per
        row (bit for bit the wrapped layer at init, its memory layout kept)."""
        if self.base_layer.training and isinstance(self.base_layer, nn.modules.batchnorm._BatchNorm):
            return self._affine(x, comp, None)  # batch statistics: normalise once
        out = self._fused(x, 0)
        for k in range(1, self.member_weight.shape[0]):
            mask = (comp == k).view(-1, *([1] * (x.dim() - 1)))
            out = torch.where(mask, self._fused(x, k), out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with channels at ``self.axis`` → same shape (a norm-activation layer's
        ``drop`` and ``act`` applied after, as the layer does)."""
        comp = self.context.components_for(x.shape[0], x.device)
        if self.context.deterministic or self.noise_std == 0.0:
            return batchnorm_epilogue(self.base_layer, self._mean_forward(x, comp))
        eps = self.context.draw(self.layer_id, x.shape[0], (self.num_nodes(),), x.device)
        scale = 1.0 + (self.noise_std * knob_value(self)) * eps  # [R, C] fp32
        return batchnorm_epilogue(self.base_layer, self._affine(x, comp, scale))

    def kl(self) -> torch.Tensor:
        """Prior term ``Σ_k Σ_c ((γ_kc − γ₀c)² + (β_kc − β₀c)²) / (2 s²)`` (fp32)."""
        dw = self.member_weight.float() - self.prior_weight
        db = self.member_bias.float() - self.prior_bias
        return (dw.pow(2).sum() + db.pow(2).sum()) / (2.0 * self.prior_std**2)

    def extra_repr(self) -> str:
        k, c = self.member_weight.shape
        return f"members={k}, channels={c}, axis={self.axis}, noise_std={self.noise_std}"
