"""Weight pruning of a trained mean-field posterior (Blundell et al. 2015, §5.1).

Signal-to-noise pruning removes the weights with the smallest ``|μ|/σ`` across
all wrapped layers; magnitude pruning (the naive baseline) removes the smallest
``|μ|``. A pruned weight becomes a point mass at 0 (``μ = 0``, ``σ ≈ 0``), so
every member of the predictor sees it as exactly zero. Prune after training:
the KL of a point mass is not meaningful, so do not keep training the pruned
posterior.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bayesify.errors import BayesifyError
from bayesify.methods.meanfield.layers import MeanFieldLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

#: softplus(_PRUNED_RHO) ≈ 9e-14: numerically a point mass
_PRUNED_RHO = -30.0


@dataclass
class PruneResult:
    """``masks``: per layer name, ``True`` where a weight was kept; ``threshold`` of the score."""

    masks: dict[str, torch.Tensor]
    threshold: float
    pruned: int
    total: int

    @property
    def fraction(self) -> float:
        return self.pruned / max(self.total, 1)


def signal_to_noise(layer: MeanFieldLayer) -> torch.Tensor:
    """``|μ| / σ`` of every weight of ``layer`` (shape of the weight)."""
    return layer.weight_mu.detach().abs() / layer.weight_std.detach()


def _layers(bnn: BayesianModel) -> dict[str, MeanFieldLayer]:
    layers = {n: m for n, m in bnn.bayesian_layers().items() if isinstance(m, MeanFieldLayer)}
    if not layers:
        raise BayesifyError(
            f"pruning needs a 'meanfield' posterior; this model uses {bnn.method_name!r}"
        )
    return layers


@torch.no_grad()
def _prune(bnn: BayesianModel, fraction: float, score_fn) -> PruneResult:
    if not 0.0 <= fraction < 1.0:
        raise BayesifyError(f"fraction must be in [0, 1), got {fraction}")
    layers = _layers(bnn)
    scores = {name: score_fn(layer).float() for name, layer in layers.items()}
    flat = torch.cat([s.flatten().cpu() for s in scores.values()])
    count = round(fraction * flat.numel())
    if count == 0:
        threshold = float("-inf")
        masks = {n: torch.ones_like(s, dtype=torch.bool) for n, s in scores.items()}
    else:
        threshold = float(flat.kthvalue(count).values)
        # exactly `count` weights: rank globally, break ties by position
        order = flat.argsort(stable=True)
        keep = torch.ones(flat.numel(), dtype=torch.bool)
        keep[order[:count]] = False
        masks, start = {}, 0
        for name, s in scores.items():
            masks[name] = keep[start:start + s.numel()].view_as(s).to(s.device)
            start += s.numel()
    for name, layer in layers.items():
        mask = masks[name]
        layer.weight_mu.masked_fill_(~mask, 0.0)
        layer.weight_rho.masked_fill_(~mask, _PRUNED_RHO)
    return PruneResult(masks=masks, threshold=threshold, pruned=count, total=flat.numel())


def snr_prune(bnn: BayesianModel, fraction: float) -> PruneResult:
    """Prune (in place) the ``fraction`` of weights with the lowest ``|μ|/σ``, globally."""
    return _prune(bnn, fraction, signal_to_noise)


def magnitude_prune(bnn: BayesianModel, fraction: float) -> PruneResult:
    """Naive baseline: prune (in place) the ``fraction`` of weights with the lowest ``|μ|``."""
    return _prune(bnn, fraction, lambda layer: layer.weight_mu.detach().abs())
