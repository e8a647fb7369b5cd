"""SWAG wrapper: a passthrough layer that holds the SWAG moments of its parameters.

The wrapped layer's own parameters are what SGD moves during collection; at
prediction the method swaps sampled values in for them with
``torch.func.functional_call`` (keys ``<name>.base_layer.<param>``), so the
wrapper's forward is the base layer's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer
from bayesify.methods.swag.config import SWAGConfig


class SWAGMoments(nn.Module):
    """Buffers of one layer: ``<p>_mean``, ``<p>_sq_mean`` (shape of p), ``<p>_dev [R, *p]``.

    ``count`` = snapshots seen (T); deviation ``i`` lives in row ``i % R`` (a ring
    buffer of the last R). With ``pinned_to_cpu`` the buffers ignore ``.to()`` /
    ``.cuda()`` so that big models keep their moments in host memory.
    """

    def __init__(self, shapes: dict[str, torch.Size], *, rank: int, dtype: torch.dtype,
                 device: torch.device, pinned_to_cpu: bool) -> None:
        super().__init__()
        self.pinned_to_cpu = pinned_to_cpu
        self.rank = rank
        self.names = list(shapes)
        device = torch.device("cpu") if pinned_to_cpu else device
        for name, shape in shapes.items():
            self.register_buffer(f"{name}_mean", torch.zeros(shape, dtype=dtype, device=device))
            self.register_buffer(f"{name}_sq_mean", torch.zeros(shape, dtype=dtype, device=device))
            self.register_buffer(f"{name}_dev", torch.zeros((rank, *shape), dtype=dtype, device=device))
        self.register_buffer("count", torch.zeros((), dtype=torch.long, device=device))

    def _apply(self, fn: Callable, recurse: bool = True) -> SWAGMoments:
        # host-memory moments: model.to(device) must not copy them to the accelerator
        if self.pinned_to_cpu:
            return self
        return super()._apply(fn, recurse)

    def mean(self, name: str) -> torch.Tensor:
        return getattr(self, f"{name}_mean")

    def sq_mean(self, name: str) -> torch.Tensor:
        return getattr(self, f"{name}_sq_mean")

    def deviations(self, name: str) -> torch.Tensor:
        """``[R_used, *shape]``: the deviations actually collected (R_used = min(T, R))."""
        return getattr(self, f"{name}_dev")[: self.collected_rank]

    @property
    def collected_rank(self) -> int:
        return min(int(self.count), self.rank)

    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()

    @torch.no_grad()
    def update(self, values: dict[str, torch.Tensor]) -> None:
        """One snapshot θ_T: running mean and mean of squares, then D[T % R] = θ_T − θ̄_T.

        ``θ̄_T = (T−1)/T · θ̄_{T−1} + θ_T / T`` (the deviation uses the mean *after* the update).
        """
        t = int(self.count) + 1
        for name in self.names:
            mean, sq = self.mean(name), self.sq_mean(name)
            theta = values[name].detach().to(mean.device, mean.dtype)
            mean.mul_((t - 1) / t).add_(theta, alpha=1.0 / t)
            sq.mul_((t - 1) / t).add_(theta * theta, alpha=1.0 / t)
            getattr(self, f"{name}_dev")[(t - 1) % self.rank].copy_(theta - mean)
        self.count.fill_(t)


class SWAGLayer(BayesianLayer):
    """Wraps a Linear/Conv; holds :class:`SWAGMoments` of its parameters (weight, bias)."""

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: SWAGConfig) -> None:
        super().__init__(base_layer, context)
        params = dict(base_layer.named_parameters())
        weight = next(iter(params.values()))
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        self.param_names = list(params)
        self.moments = SWAGMoments(
            {n.replace(".", "__"): p.shape for n, p in params.items()},
            rank=config.max_rank, dtype=dtype, device=weight.device,
            pinned_to_cpu=config.moments_on_cpu,
        )

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.base_layer(x, *args, **kwargs)

    def base_values(self) -> dict[str, torch.Tensor]:
        """Current values of the wrapped parameters, keyed like the moments."""
        return {n.replace(".", "__"): p for n, p in self.base_layer.named_parameters()}

    def num_nodes(self) -> int:
        return sum(p.numel() for p in self.base_layer.parameters())

    def extra_repr(self) -> str:
        return (f"params={self.num_nodes()}, rank={self.moments.rank}, "
                f"snapshots={int(self.moments.count)}, on_cpu={self.moments.pinned_to_cpu}")
