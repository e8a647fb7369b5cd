"""SWAG wrapper: a passthrough layer that holds the SWAG moments of its parameters.

The wrapped layer's own parameters are what SGD moves during collection; at
prediction the method swaps sampled values in for them with
``torch.func.functional_call`` (keys ``<name>.theta.<param>``), so the
wrapper's forward is the base layer's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer
from bayesify.methods.swag.config import SWAGConfig


class SWAGMoments(nn.Module):
    """Buffers of one layer: ``<p>_mean``, ``<p>_sq_mean`` (shape of p), ``<p>_dev [R, *p]``.

    ``count`` = snapshots seen (T); deviation ``i`` lives in row ``i % R`` (a ring
    buffer of the last R). With ``pinned_to_cpu`` the buffers ignore ``.to()`` /
    ``.cuda()`` so that big models keep their moments in host memory.
    """

    #: the step guard does not copy these before every step: only the post-step
    #: collection writes them (checkpoint and posterior writes still check them)
    bayesify_guard_buffers = False

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
    """Wraps a Linear/Conv with a trainable copy ``theta`` of its parameters and the
    :class:`SWAGMoments` of that copy.

    SGD moves ``theta`` (never the base layer's own tensors, so ``unwrap()`` is the
    original network); after ``fit`` ``theta`` holds θ̄, the SWA solution. Prediction
    swaps sampled values in for ``theta.*`` with ``torch.func.functional_call``.
    """

    runs_base_hooks = True  # functional_call on the original layer: its hooks run

    deals_rows = False  # every row of a pass computes alike

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: SWAGConfig) -> None:
        super().__init__(base_layer, context)
        params = dict(base_layer.named_parameters())
        weight = next(iter(params.values()))
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        self.param_names = list(params)
        self.theta = nn.ParameterDict({n.replace(".", "__"): nn.Parameter(p.detach().clone())
                                       for n, p in params.items()})
        self.moments = SWAGMoments(
            {n.replace(".", "__"): p.shape for n, p in params.items()},
            rank=config.max_rank, dtype=dtype, device=weight.device,
            pinned_to_cpu=config.moments_on_cpu,
        )

    def forward(self, *args, **kwargs) -> torch.Tensor:
        values = {n: self.theta[n.replace(".", "__")] for n in self.param_names}
        return functional_call(self.base_layer, values, args, kwargs)

    def mean_weight(self, name: str) -> torch.Tensor | None:
        key = name.replace(".", "__")
        if key in self.theta:
            return self.theta[key]
        if name == "bias":
            return None
        raise AttributeError(name)

    def base_values(self) -> dict[str, torch.Tensor]:
        """Current values of the working copy, keyed like the moments."""
        return dict(self.theta.items())

    def num_nodes(self) -> int:
        return sum(p.numel() for p in self.base_layer.parameters())

    def extra_repr(self) -> str:
        return (f"params={self.num_nodes()}, rank={self.moments.rank}, "
                f"snapshots={int(self.moments.count)}, on_cpu={self.moments.pinned_to_cpu}")


class SWAGBatchNorm(BayesianLayer):
    """A BatchNorm whose running statistics belong to the posterior, not the base.

    ``running_mean`` / ``running_var`` ``[C]``: the statistics of θ̄ (recomputed by
    ``fit``; the pretrained ones until then), used in eval mode; ``member_mean`` /
    ``member_var`` ``[N, C]``: those of the N sampled networks of the default
    predictor (seed 0), stored so that a reloaded posterior predicts exactly as the
    fitted one without the training data. The base BatchNorm is never changed.
    """

    deals_rows = False  # every row of a pass computes alike

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, members: int) -> None:
        super().__init__(base_layer, context)
        mean, var = base_layer.running_mean.detach(), base_layer.running_var.detach()
        self.register_buffer("running_mean", mean.clone())
        self.register_buffer("running_var", var.clone())
        self.register_buffer("member_mean", mean.clone().unsqueeze(0).repeat(members, 1))
        self.register_buffer("member_var", var.clone().unsqueeze(0).repeat(members, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if base.training:  # BatchNorm trained on purpose (bn_train) or statistics recomputed
            return base(x)
        # the base module's own forward with the posterior's statistics: a BatchNorm subclass
        # that also applies an activation (timm's BatchNormAct2d) keeps it (a bare
        # F.batch_norm here dropped EfficientNet's ReLU6: logits of 1e15 on Lite0)
        return functional_call(base, {"running_mean": self.running_mean,
                                      "running_var": self.running_var}, (x,))

    def mean_weight(self, name: str) -> torch.Tensor | None:
        return getattr(self.base_layer, name)


def swag_batchnorm_wrappers(model: nn.Module, context: SamplingContext, members: int,
                            targets: list[str]) -> dict[str, SWAGBatchNorm]:
    """A :class:`SWAGBatchNorm` for every BatchNorm that tracks statistics (not installed)."""
    inside = tuple(f"{t}." for t in targets)
    return {name: SWAGBatchNorm(m, context=context, members=members)
            for name, m in model.named_modules()
            if name and isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and m.running_mean is not None and not name.startswith(inside)}
