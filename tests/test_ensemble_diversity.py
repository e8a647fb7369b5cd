"""Ensemble members that really differ (issue 31): online bagging (``bootstrap=True``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit


def _setup(**options) -> tuple[object, DataLoader]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 5, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    bnn = bayesify(net, method="ensemble", components=3, init_noise=0.0, **options)
    return bnn, DataLoader(TensorDataset(x, y), batch_size=16)


def _spread(bnn) -> float:
    w = bnn.model[2].member_weight.detach()
    return float((w - w.mean(0)).abs().max())


def test_bootstrap_members_differ_where_plain_members_stay_identical() -> None:
    plain, loader = _setup()
    fit(plain, loader, epochs=2)
    assert _spread(plain) < 1e-6  # identical members on identical batches stay identical
    bagged, loader = _setup(bootstrap=True)
    fit(bagged, loader, epochs=2)
    assert _spread(bagged) > 1e-4  # ≫ 1e-6 (the default cosine rate is small at the end)


def test_bootstrap_loss_is_the_poisson_weighted_member_mean() -> None:
    bnn, loader = _setup(bootstrap=True)
    x, y = next(iter(loader))
    step = bnn.method.step()
    nll, _ = step.terms(bnn, x, y, torch.Generator().manual_seed(3))
    with bnn.context.use(None):
        logits, targets = step.forward(bnn, x, y)
    rows = F.cross_entropy(logits, targets, reduction="none").view(3, -1)
    w = torch.poisson(torch.ones(rows.shape), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(nll, ((w * rows).sum(1) / w.sum(1).clamp_min(1)).mean())
