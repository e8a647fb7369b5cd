"""One set of BatchNorm statistics and affine parameters per ensemble member.

For the batch-tiled families (rank1, batchensemble, ensemble) every member is a
different network, so its BatchNorm should normalise with its own statistics and
its own ``γ, β`` (Wen et al. 2020; Dusenberry et al. 2020). :class:`MemberBatchNorm`
wraps a pretrained ``_BatchNorm`` (kept as ``base_layer`` so ``unwrap()`` puts it
back), holds ``[K, C]`` copies of its parameters and running statistics, and routes
every row to the copy of its component (``context.components_for``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer, broadcast_rows

BATCHNORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


def batchnorm_epilogue(base: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """What a BatchNorm subclass does after the normalisation: timm's ``BatchNormAct2d``
    (EfficientNet, MobileNet, …) applies its ``drop`` and its activation inside the same
    module, so a wrapper that re-implements the normalisation must apply them too
    (dropping them turned ReLU6 networks into unbounded ones: EfficientNet-Lite0's
    logits reached 1e15). Plain ``_BatchNorm`` modules have neither: ``out`` unchanged.
    The same for timm's other norm-activation layers (``GroupNormAct``, ``LayerNormAct2d``,
    ``FrozenBatchNormAct2d``, …) and Hugging Face BiT's ``BitGroupNormActivation``
    (``activation``)."""
    drop, act = getattr(base, "drop", None), getattr(base, "act", None)
    if not isinstance(act, nn.Module):
        act = getattr(base, "activation", None)
    if isinstance(drop, nn.Module):
        out = drop(out)
    if isinstance(act, nn.Module):
        out = act(out)
    return out


class MemberBatchNorm(BayesianLayer):
    """Per-member BatchNorm: ``y = (x − μ_k) / sqrt(σ²_k + eps) · γ_k + β_k`` for row's member k.

    Parameters ``member_weight, member_bias [K, C]`` (trainable posterior tensors, initialised from
    the pretrained BN); buffers ``member_running_mean, member_running_var [K, C]``. The pretrained
    BN (``base_layer``) decides the mode: :class:`BayesianModel` keeps it in eval while
    fine-tuning (frozen statistics, one fused per-row affine), and when BN training is
    switched on each member normalises its own rows with batch statistics and updates
    its own running statistics.
    """

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, components: int) -> None:
        super().__init__(base_layer, context)
        c = base_layer.num_features
        ref = base_layer.running_mean if base_layer.running_mean is not None else None
        factory = {"device": ref.device if ref is not None else None, "dtype": torch.float32}
        weight = base_layer.weight.detach() if base_layer.affine else torch.ones(c, **factory)
        bias = base_layer.bias.detach() if base_layer.affine else torch.zeros(c, **factory)
        self.member_weight = nn.Parameter(weight.float().expand(components, c).clone())
        self.member_bias = nn.Parameter(bias.float().expand(components, c).clone())
        mean = ref if ref is not None else torch.zeros(c, **factory)
        var = base_layer.running_var if base_layer.running_var is not None else torch.ones(c, **factory)
        self.register_buffer("member_running_mean", mean.detach().float().expand(components, c).clone())
        self.register_buffer("member_running_var", var.detach().float().expand(components, c).clone())

    @property
    def eps(self) -> float:
        return self.base_layer.eps

    def num_nodes(self) -> int:
        return self.member_weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, C, *spatial]`` → same shape; row r normalised by member ``comp[r]``."""
        comp = self.context.components_for(x.shape[0], x.device)
        if self.base_layer.training:
            return batchnorm_epilogue(self.base_layer, self._batch_stats_forward(x, comp))
        # frozen statistics: BN is a per-channel affine map, gathered per row
        scale = self.member_weight * torch.rsqrt(self.member_running_var + self.eps)  # [K, C]
        shift = self.member_bias - self.member_running_mean * scale
        scale = broadcast_rows(scale.index_select(0, comp), x, 1).to(x.dtype)
        shift = broadcast_rows(shift.index_select(0, comp), x, 1).to(x.dtype)
        return batchnorm_epilogue(self.base_layer, torch.addcmul(shift, x, scale))

    def _batch_stats_forward(self, x: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
        """Each member normalises its own rows and updates its own running statistics."""
        base = self.base_layer
        # momentum=None (cumulative average) has no per-member counter: use torch's 0.1
        momentum = 0.1 if base.momentum is None else base.momentum
        pieces, order = [], []
        for k in torch.unique(comp).tolist():
            idx = (comp == k).nonzero().squeeze(1)
            pieces.append(F.batch_norm(
                x.index_select(0, idx), self.member_running_mean[k], self.member_running_var[k],
                self.member_weight[k].to(x.dtype), self.member_bias[k].to(x.dtype),
                training=True, momentum=momentum, eps=base.eps,
            ))
            order.append(idx)
        out = torch.cat(pieces, 0)
        inverse = torch.argsort(torch.cat(order))
        return out.index_select(0, inverse)

    def extra_repr(self) -> str:
        return f"members={self.member_weight.shape[0]}, features={self.member_weight.shape[1]}"


def batchnorm_names(model: nn.Module, targets: list[str] = ()) -> list[str]:
    """Qualified names of the BatchNorm layers of ``model`` outside the ``targets``."""
    inside = tuple(f"{t}." for t in targets)
    return [name for name, module in model.named_modules()
            if name and isinstance(module, BATCHNORM_TYPES) and not name.startswith(inside)]


def member_batchnorm_wrappers(model: nn.Module, context: SamplingContext, components: int,
                              targets: list[str] = ()) -> dict[str, MemberBatchNorm]:
    """A :class:`MemberBatchNorm` for every BatchNorm of ``model`` (built, not installed).

    The factory installs them together with the target wrappers, so a failed call
    never leaves a half-modified model.
    """
    modules = dict(model.named_modules())
    return {name: MemberBatchNorm(modules[name], context=context, components=components)
            for name in batchnorm_names(model, targets)}
