"""BatchNorm statistics of a sampled network (SWA's ``update_bn`` for functional calls).

After a network θ_s is drawn, its BatchNorm running statistics are recomputed with a
pass over (a fraction of) the training data in train mode with cumulative-average
momentum (``momentum=None``): ``running_mean = mean over batches of the batch means``,
exactly what ``torch.optim.swa_utils.update_bn`` does, but on fresh buffers passed to
``torch.func.functional_call`` so the model's own statistics stay untouched. The batches
come from a :class:`~bayesify.core.fitting.BatchSource`: the fit context's share of the
training data during ``fit``, a loader given to the predictor afterwards.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from bayesify.core.fitting import BatchSource

_BN = nn.modules.batchnorm._BatchNorm


def batchnorm_modules(model: nn.Module) -> dict[str, _BN]:
    """BatchNorm layers that track running statistics, by qualified name."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, _BN) and m.track_running_stats and m.running_mean is not None}


def batchnorm_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the running statistics of every BatchNorm layer (functional_call keys)."""
    out = {}
    for name, m in batchnorm_modules(model).items():
        out[f"{name}.running_mean"] = m.running_mean.detach().clone()
        out[f"{name}.running_var"] = m.running_var.detach().clone()
        out[f"{name}.num_batches_tracked"] = m.num_batches_tracked.detach().clone()
    return out


@torch.no_grad()
def recompute_batchnorm(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    source: BatchSource,
    *,
    fraction: float,
) -> dict[str, torch.Tensor]:
    """Running statistics of every BatchNorm layer of ``model`` evaluated at ``params``.

    Returns ``{"<bn>.running_mean": [C], "<bn>.running_var": [C], "<bn>.num_batches_tracked"}``
    (cumulative averages over ``source.batches(fraction)``; averaged over the processes
    sharing the pass by ``source.mean``).
    """
    bns = batchnorm_modules(model)
    if not bns or fraction <= 0:
        return {}
    state = {}
    for name, m in bns.items():
        state[f"{name}.running_mean"] = torch.zeros_like(m.running_mean)
        state[f"{name}.running_var"] = torch.ones_like(m.running_var)
        state[f"{name}.num_batches_tracked"] = torch.zeros_like(m.num_batches_tracked)
    momenta = {name: m.momentum for name, m in bns.items()}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # dropout etc. off; only BatchNorm runs in train mode
    try:
        for m in bns.values():
            m.momentum = None
            m.train()
        for batch in source.batches(fraction):
            functional_call(model, {**params, **state}, batch.args, batch.kwargs)
    finally:
        for name, m in bns.items():
            m.momentum = momenta[name]
        for m, training in modes:
            m.training = training
    for value in state.values():
        if value.is_floating_point():
            value.copy_(source.mean(value))
    return state
