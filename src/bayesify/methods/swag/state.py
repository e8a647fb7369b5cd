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

import logging
from typing import TYPE_CHECKING, Any

import torch

from bayesify.core.batch import call_model
from bayesify.core.names import base_name
from bayesify.core.outputs import logits_of
from bayesify.core.state import derived
from bayesify.errors import BayesifyError
from bayesify.kit import feature_layers
from bayesify.kit.steps import count_correct, keeps_accuracy
from bayesify.methods.swag import posterior as post
from bayesify.methods.swag.batchnorm import recompute_batchnorm
from bayesify.methods.swag.config import SWAGConfig
from bayesify.methods.swag.layers import SWAGBatchNorm, SWAGLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)

BN_SOURCE = "bn_source"
_BN_CACHE = derived("swag_bn_cache")
#: ``swag_bn_members`` values: 0 = nothing stored, 1 = the seed-0 members' recomputed
#: statistics are stored; PRETRAINED_BN = recomputation was rejected
#: (:func:`choose_batchnorm`): θ̄ and every sampled network keep the pretrained statistics
PRETRAINED_BN = 2
#: training accuracy (a fraction) recomputed statistics may cost θ̄ against the pretrained
#: ones before they are rejected
BN_TOLERANCE = 0.01
#: labelled training examples (over the processes) that decide it
BN_ROWS = 1024


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
    with feature_layers.paused():  # not the rows a member forward predicts (heads' taps)
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
    if pretrained_batchnorm(bnn):
        return [{}] * num_members  # the wrappers' statistics, the pretrained ones, for every member
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
    if (not wrappers or bnn.runtime.get(BN_SOURCE) is None or config.bn_update_fraction == 0
            or pretrained_batchnorm(bnn)):
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


def pretrained_batchnorm(bnn: BayesianModel) -> bool:
    """Whether fit rejected recomputed statistics (:func:`choose_batchnorm`)."""
    return int(bnn.state.value("swag_bn_members")) == PRETRAINED_BN


@torch.no_grad()
def _install(wrappers: dict[str, SWAGBatchNorm], stats: dict[str, torch.Tensor]) -> None:
    for name, w in wrappers.items():
        w.running_mean.copy_(stats[f"{name}.running_mean"])
        w.running_var.copy_(stats[f"{name}.running_var"])


@torch.no_grad()
def choose_batchnorm(bnn: BayesianModel, config: SWAGConfig, ctx: Any,
                     rows: list[tuple[Any, torch.Tensor]]) -> dict[str, Any]:
    """Recomputed or pretrained BatchNorm statistics for θ̄ and its samples, by the labels.

    SGD trained θ̄ through the pretrained statistics (BatchNorm frozen). Recomputing them
    from the training data is SWA's rule, and what a network trained briefly (statistics
    still lagging its weights) needs; but statistics that came from other data (ImageNet's,
    under a head fitted to new images) are part of the function θ̄ learned, and recomputing
    them broke it: on EfficientNet-Lite0 with a 10-way digit head SWA's mean fell from 0.84
    to 0.17 test accuracy. So θ̄ predicts ``rows`` (labelled training examples) with both:
    where the recomputed statistics lose more than :data:`BN_TOLERANCE` of accuracy against
    the pretrained ones (counts summed over the DDP ranks: every rank decides alike), every
    network keeps the pretrained statistics (``swag_bn_members`` = :data:`PRETRAINED_BN`,
    saved), with a warning. Labels, not flipped decisions: a flip cannot tell a repair from
    damage. Returns the record entries."""
    wrappers = bn_wrappers(bnn)
    if (not wrappers or bnn.runtime.get(BN_SOURCE) is None or config.bn_update_fraction == 0
            or post.snapshots(layers(bnn)) == 1):
        return {}
    pretrained = {f"{n}.{k}": getattr(w.base_layer, k).detach().clone()
                  for n, w in wrappers.items() for k in ("running_mean", "running_var")}
    recomputed = recompute(bnn, config, {})
    counts = torch.zeros(3, dtype=torch.float64, device=bnn.device)
    try:
        for which, stats in enumerate((pretrained, recomputed)):
            _install(wrappers, stats)
            counts[which] = count_correct(bnn.model, rows,
                                          lambda x: logits_of(call_model(bnn.model, x)),
                                          bnn.device)
        counts[2] = float(sum(y.shape[0] for _, y in rows))
    finally:
        _install(wrappers, pretrained)  # θ̄'s statistics are decided below
    guard = keeps_accuracy(ctx, counts, BN_TOLERANCE)  # counts summed over the ranks
    if guard is None:  # no labelled rows on any rank: SWA's rule
        return {}
    kept, (acc_pretrained, acc_recomputed), total = guard
    record = {"swag_bn_train_accuracy_pretrained": acc_pretrained,
              "swag_bn_train_accuracy_recomputed": acc_recomputed}
    if kept is not None:
        return record | {"swag_batchnorm": "recomputed"}
    for w in wrappers.values():
        w.member_mean.copy_(w.running_mean.expand_as(w.member_mean))
        w.member_var.copy_(w.running_var.expand_as(w.member_var))
    bnn.state.set("swag_bn_members", PRETRAINED_BN)
    forget_batchnorm(bnn)
    if ctx.rank == 0:
        logger.warning(
            "swag: BatchNorm statistics recomputed from the training data take the SWA mean "
            "from %.4f to %.4f accuracy on %d training examples (more than %g lost): the "
            "pretrained statistics came from other data and the weights were trained through "
            "them; every sampled network keeps them (bn_update_fraction=0 says so up front)",
            acc_pretrained, acc_recomputed, total, BN_TOLERANCE)
    return record | {"swag_batchnorm": "pretrained"}
