"""Rank-1 multiplicative layers shared by rank1 (Bayesian) and batchensemble (deterministic).

Member k of a wrapped Linear/Conv uses the weight ``W_k = W ∘ (s_k r_kᵀ)``, computed
without materialising it (Wen et al. 2020, eq. 2):

    out = ((x ∘ r_k) W) ∘ s_k + b_k

``r [K, C_in]`` scales input channels (shared over pixels / tokens), ``s [K, C_out]``
output channels, ``b_k`` is a per-member bias (or the shared base bias). The rank-1
BNN (Dusenberry et al. 2020) puts Gaussians ``N(μ, softplus(ρ)²)`` on r and s.
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
    out_channels,
)
from bayesify.errors import BayesifyError
from bayesify.kit.gaussian import gaussian_kl, inverse_softplus
from bayesify.kit.knobs import times_knob
from bayesify.kit.tiled import TiledMethod
from bayesify.kit.weightspace import apply_layer, has_own_forward

INIT_CHOICES = ("random_sign", "normal", "ones")




def init_factor(shape: tuple[int, int], *, init: str, sign_prob: float, std: float,
                device: torch.device | None) -> torch.Tensor:
    """Initial fast weights ``[K, C]``: random signs ±1 (P(+1) = ``sign_prob``),
    ``N(1, std²)`` or exact ones (identity)."""
    if init == "ones":
        return torch.ones(shape, device=device)
    if init == "normal":
        return 1.0 + std * torch.randn(shape, device=device)
    if init == "random_sign":
        plus = torch.rand(shape, device=device) < sign_prob
        return torch.where(plus, 1.0, -1.0)
    raise BayesifyError(f"unknown init {init!r}; use one of {INIT_CHOICES}")


def forward_without_bias(module: nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x W`` of a Linear / Conv (its padding mode, stride, groups) with no bias added."""
    weight = module.weight if weight is None else weight
    if has_own_forward(module):  # weight standardisation, same padding: its own forward
        return apply_layer(module, x, weight, None)
    if isinstance(module, nn.Linear):
        return F.linear(x, weight)
    # _conv_forward applies padding_mode, stride, dilation and groups of the module
    return module._conv_forward(x, weight, None)


class RankOneLayer(BayesianLayer):
    """``out = ((x ∘ r_k) W) ∘ s_k + b_k`` for the member k of every row.

    Parameters: ``r [K, C_in]``, ``s [K, C_out]`` (posterior means when
    ``stochastic``), ``r_rho [K, C_in]``, ``s_rho [K, C_out]`` (std = softplus(ρ)),
    ``member_bias [K, C_out]`` (initialised from the base bias) when requested and
    the base layer has a bias. With r = s = 1 and b_k = b it is the base layer.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        *,
        context: SamplingContext,
        components: int,
        init: str,
        sign_prob: float = 0.5,
        init_mean_std: float = 0.5,
        member_bias: bool = True,
        stochastic: bool = False,
        init_std: float = 0.03,
        learn_std: bool = True,
        prior_mean: float = 1.0,
        prior_std: float = 0.1,
    ) -> None:
        super().__init__(base_layer, context)
        if isinstance(base_layer, nn.modules.conv._ConvTransposeNd):
            raise TypeError("rank-1 layers wrap Linear and Conv1d/2d/3d, not ConvTranspose")
        k, c_in, c_out = components, in_channels(base_layer), out_channels(base_layer)
        self.axis = channel_axis(base_layer)
        self.stochastic = stochastic
        self.prior_mean, self.prior_std = prior_mean, prior_std
        device = base_layer.weight.device
        opts = {"init": init, "sign_prob": sign_prob, "std": init_mean_std, "device": device}
        self.r = nn.Parameter(init_factor((k, c_in), **opts))
        self.s = nn.Parameter(init_factor((k, c_out), **opts))
        if stochastic:
            rho0 = inverse_softplus(torch.tensor(float(init_std)))
            self.r_rho = nn.Parameter(torch.full((k, c_in), rho0.item(), device=device),
                                      requires_grad=learn_std)
            self.s_rho = nn.Parameter(torch.full((k, c_out), rho0.item(), device=device),
                                      requires_grad=learn_std)
        bias = base_layer.bias
        self.member_bias = (
            nn.Parameter(bias.detach().float().expand(k, c_out).clone())
            if member_bias and bias is not None else None
        )

    def num_nodes(self) -> int:
        return self.r.shape[1] + self.s.shape[1]

    def factors(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row ``r [R, C_in]``, ``s [R, C_out]`` and the component ``[R]`` of each row.

        Stochastic layers draw ``μ + c·softplus(ρ) ε`` (one ε per row in training, per
        member at prediction; ``c`` the validation-tuned ``rank1_noise_scale``, 1 in
        training); deterministic mode / batchensemble use the means.
        """
        comp = self.context.components_for(rows, device)
        r, s = self.r.index_select(0, comp), self.s.index_select(0, comp)
        if self.stochastic and not self.context.deterministic:
            c_in = r.shape[1]
            # one draw for both factors: the per-member stream is seeded per layer id
            eps = self.context.draw(self.layer_id, rows, (c_in + s.shape[1],), device)
            r = r + times_knob(F.softplus(self.r_rho), self).index_select(0, comp) * eps[:, :c_in]
            s = s + times_knob(F.softplus(self.s_rho), self).index_select(0, comp) * eps[:, c_in:]
        return r, s, comp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, s, comp = self.factors(x.shape[0], x.device)
        h = forward_without_bias(self.base_layer, x * broadcast_rows(r, x, self.axis).to(x.dtype))
        s = broadcast_rows(s, h, self.axis).to(h.dtype)
        if self.member_bias is not None:
            bias = broadcast_rows(self.member_bias.index_select(0, comp), h, self.axis).to(h.dtype)
            return torch.addcmul(bias, h, s)
        base_bias = self.base_layer.bias
        if base_bias is None:
            return h * s
        shape = [1] * h.dim()
        shape[self.axis] = base_bias.shape[0]
        return torch.addcmul(base_bias.view(shape).to(h.dtype), h, s)

    def kl(self) -> torch.Tensor:
        """Mean over the K members of Σ_channels KL(N(μ, σ²) ‖ N(prior_mean, prior_std²)) for r, s.

        The likelihood term is the *mean* NLL over the K-tiled batch, i.e. each member's
        NLL weighted 1/K; the member's KL must carry the same 1/K (Dusenberry et al. sum
        both over members). Summing the KL over members instead weighted the prior K
        times too strongly against the data.
        """
        if not self.stochastic:
            return torch.zeros((), device=self.r.device)
        return self._kl(torch.cat([self.r, self.s], 1), torch.cat([self.r_rho, self.s_rho], 1))

    def _kl(self, mean: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        var = F.softplus(rho.float()).pow(2)
        kl = gaussian_kl(mean.float(), var, self.prior_mean, self.prior_std).sum()
        return kl / mean.shape[0]

    @staticmethod
    def kl_many(layers: list[RankOneLayer]) -> torch.Tensor:
        """Σ :meth:`kl` over ``layers`` as one computation on the concatenated factors
        (deterministic layers, or other K, prior or device: one by one)."""
        if not all(lay.stochastic for lay in layers):
            return torch.stack([lay.kl().float() for lay in layers]).sum()
        return concatenated_kl(
            layers, key=lambda lay: (lay.r.shape[0], lay.prior_mean, lay.prior_std, lay.r.device),
            parts=lambda lay: ([lay.r, lay.s], [lay.r_rho, lay.s_rho]), kl=RankOneLayer._kl)

    def fast_weights(self) -> list[nn.Parameter]:
        """The rank-1 factors (means and stds), as opposed to the biases."""
        out = [self.r, self.s]
        if self.stochastic:
            out += [self.r_rho, self.s_rho]
        return out

    def extra_repr(self) -> str:
        k, c_in = self.r.shape
        return (f"members={k}, in={c_in}, out={self.s.shape[1]}, stochastic={self.stochastic}, "
                f"member_bias={self.member_bias is not None}")


def network_state(bnn: nn.Module) -> dict[str, torch.Tensor]:
    """The ``state_dict`` entries that make every member the base network (at noise scale 0
    for rank1): every fast weight ``r``, ``s`` at 1 (the initial ones are spread around 1, so
    the state a fit began with is not the network; ``fit``'s keep-best falls back to this one
    and weighs it, with Laplace heads, against the trained members). The members' biases
    start as the base bias and stay as the fit began."""
    out = {}
    for name, layer in bnn.named_modules():
        if isinstance(layer, RankOneLayer):
            out[f"{name}.r"] = torch.ones_like(layer.r)
            out[f"{name}.s"] = torch.ones_like(layer.s)
    return out


def spread_per_network(layers: dict[str, nn.Module], *, init: str) -> float:
    """Make the rank-one layers' spreads the whole network's: the 'normal' initial factors'
    offsets from 1, the posterior stds and the prior std are divided by √(2L) for L
    wrapped layers (two factor vectors each). L layers each perturbing the function
    independently by σ move the logits like one perturbation of σ·√(2L): at 0.1 per factor
    the tiny ViT of the second quality protocol began its fit 0.016 nats above the network
    on validation, and the start state ``fit`` falls back to was that far off too. Returns
    the factor (1 without rank-one layers)."""
    rank_one = [m for m in layers.values() if isinstance(m, RankOneLayer)]
    if not rank_one:
        return 1.0
    shrink = 1.0 / math.sqrt(2 * len(rank_one))
    with torch.no_grad():
        for layer in rank_one:
            if init == "normal":
                layer.r.sub_(1.0).mul_(shrink).add_(1.0)
                layer.s.sub_(1.0).mul_(shrink).add_(1.0)
            if layer.stochastic:
                for rho in (layer.r_rho, layer.s_rho):
                    rho.copy_(inverse_softplus(F.softplus(rho) * shrink, floor=1e-8))
                layer.prior_std = layer.prior_std * shrink
    return shrink


class RankOneTiledMethod(TiledMethod):
    """A batch-tiled family of rank-one layers (rank1, batchensemble) whose spreads are the
    network's with ``config.per_network`` (:func:`spread_per_network`)."""

    def build(self, model: nn.Module, targets: list[str],
              context: SamplingContext) -> dict[str, nn.Module]:
        layers = super().build(model, targets, context)
        if self.config.per_network:
            spread_per_network(layers, init=self.config.init)
        return layers
