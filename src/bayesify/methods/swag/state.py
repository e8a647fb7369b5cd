"""The fitted SWAG posterior of one model: sampled networks and their BatchNorm statistics.

What is fitted lives in the layers (``theta`` = θ̄, the :class:`SWAGMoments`, the
:class:`SWAGBatchNorm` statistics) and ``bnn.state`` (scale, period, flags). What is not
saved lives in ``bnn.runtime``: ``"bn_source"`` — the
:class:`~bayesify.core.fitting.BatchSource` the BatchNorm statistics of sampled networks
are recomputed from (``fit`` installs its share of the training data; a predictor given
``bn_loader=`` installs that loader) — and the statistics recomputed per
``(seed, members)`` from that source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bayesify.core.names import base_name
from bayesify.errors import BayesifyError
from bayesify.methods.swag import posterior as post
from bayesify.methods.swag.batchnorm import recompute_batchnorm
from bayesify.methods.swag.config import SWAGConfig
from bayesify.methods.swag.layers import SWAGBatchNorm, SWAGLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

BN_SOURCE = "bn_source"
_BN_CACHE = "swag_bn_cache"


def layers(bnn: BayesianModel) -> dict[str, SWAGLayer]:
    return {n: m for n, m in bnn.bayesian_layers().items() if isinstance(m, SWAGLayer)}


def bn_wrappers(bnn: BayesianModel) -> dict[str, SWAGBatchNorm]:
    return {n: m for n, m in bnn.bayesian_layers().items() if isinstance(m, SWAGBatchNorm)}


def scale(bnn: BayesianModel) -> float:
    """The covariance scale of the samples (tuned on validation or the config's)."""
    return bnn.state.value("swag_scale")


def set_scale(bnn: BayesianModel, value: float) -> None:
    bnn.state.set("swag_scale", value)
    forget_batchnorm(bnn)


def install_scale(bnn: BayesianModel, config: SWAGConfig, value: float) -> None:
    """The scale, and the BatchNorm statistics of the default predictor's members at it
    (computed here, so every DDP rank runs the same reductions in the same order whatever
    its share of the validation data)."""
    set_scale(bnn, value)
    member_batchnorm(bnn, config, config.default_samples(), 0)


def fitted(bnn: BayesianModel) -> bool:
    return bool(bnn.state.value("swag_fitted"))


def forget_batchnorm(bnn: BayesianModel) -> None:
    """Drop recomputed member statistics (the scale or the data source changed)."""
    bnn.runtime.pop(_BN_CACHE, None)


def sample(bnn: BayesianModel, config: SWAGConfig, member: int,
           seed: int | None = 0) -> dict[str, torch.Tensor]:
    """Sampled parameters of predictive member ``member`` (reproducible from ``seed``)."""
    return post.sample_parameters(
        layers(bnn), variant=config.variant, scale=scale(bnn),
        generator=post.member_generator(seed, member), device=bnn.device,
        min_variance=config.min_variance,
    )


def recompute(bnn: BayesianModel, config: SWAGConfig,
              params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Statistics of the network at ``params`` keyed ``"<bn>.running_mean"`` etc."""
    stats = recompute_batchnorm(bnn.model, params, bnn.runtime[BN_SOURCE],
                                fraction=config.bn_update_fraction)
    return {base_name(k): v for k, v in stats.items() if not k.endswith("num_batches_tracked")}


def member_batchnorm(bnn: BayesianModel, config: SWAGConfig, num_members: int,
                     seed: int | None) -> list[dict[str, torch.Tensor]]:
    """BatchNorm statistics of every sampled member (recomputed once, then cached)."""
    wrappers = bn_wrappers(bnn)
    if wrappers and post.snapshots(layers(bnn)) == 1:
        # one snapshot (the starting network kept by fit's never-worse rule): zero spread,
        # every member is θ̄ and has θ̄'s statistics
        return [{f"{n}.running_mean": w.running_mean for n, w in wrappers.items()}
                | {f"{n}.running_var": w.running_var for n, w in wrappers.items()}
                for _ in range(num_members)]
    source = bnn.runtime.get(BN_SOURCE)
    cached = bnn.runtime.get(_BN_CACHE)
    if cached is None or cached[0] is not source:  # statistics of another data source
        cached = bnn.runtime[_BN_CACHE] = (source, {})
    cache = cached[1]
    key = (seed, num_members)
    if key in cache:
        return cache[key]
    if not wrappers or config.bn_update_fraction == 0:
        stats = [{}] * num_members
    elif (seed == 0 and num_members <= config.predict_samples
          and bnn.state.value("swag_bn_members") and source is None):
        stats = [{f"{n}.running_mean": w.member_mean[m] for n, w in wrappers.items()}
                 | {f"{n}.running_var": w.member_var[m] for n, w in wrappers.items()}
                 for m in range(num_members)]
    elif source is None:
        raise BayesifyError(
            f"SWAG stored BatchNorm statistics for {config.predict_samples} members of "
            f"seed 0; a predictor with seed={seed} and {num_members} members needs them "
            "recomputed: pass the training loader, bnn.predictor(..., bn_loader=loader)"
        )
    else:
        stats = [recompute(bnn, config, sample(bnn, config, m, seed)) for m in range(num_members)]
    cache[key] = stats
    return stats


@torch.no_grad()
def store_batchnorm(bnn: BayesianModel, config: SWAGConfig) -> None:
    """Recompute the BatchNorm statistics of θ̄ and of the seed-0 members into the
    :class:`SWAGBatchNorm` buffers (so reloaded posteriors need no data)."""
    wrappers = bn_wrappers(bnn)
    if not wrappers or bnn.runtime.get(BN_SOURCE) is None or config.bn_update_fraction == 0:
        return
    if post.snapshots(layers(bnn)) == 1:
        # one snapshot: the starting network kept by fit's never-worse rule; its statistics
        # are the pretrained ones (re-estimating them from a small fit set cost Lite0 22 points)
        return
    mean_stats = recompute(bnn, config, {})
    for name, w in wrappers.items():
        w.running_mean.copy_(mean_stats[f"{name}.running_mean"])
        w.running_var.copy_(mean_stats[f"{name}.running_var"])
    # the members' statistics do not depend on θ̄'s: those cached at this scale stay valid
    if config.variant != "swa":
        for m, stats in enumerate(member_batchnorm(bnn, config, config.predict_samples, 0)):
            for name, w in wrappers.items():
                w.member_mean[m].copy_(stats[f"{name}.running_mean"])
                w.member_var[m].copy_(stats[f"{name}.running_var"])
        bnn.state.set("swag_bn_members", 1)


def mean_network(bnn: BayesianModel) -> dict[str, torch.Tensor]:
    """θ̄ (the working copies after fit) with the BatchNorm statistics of θ̄."""
    mean = {post.theta_name(n, k): v.detach() for n, layer in layers(bnn).items()
            for k, v in layer.theta.items()}
    for n, w in bn_wrappers(bnn).items():
        mean.update({f"{n}.running_mean": w.running_mean, f"{n}.running_var": w.running_var})
    return mean
