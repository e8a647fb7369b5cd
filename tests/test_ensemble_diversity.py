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


def _relative_jitter(depth: int, **options) -> list[float]:
    """Per wrapped layer: the std of the members' w_k / w − 1."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(depth)])
    bnn = bayesify(net, method="ensemble", components=4, init_noise=0.05, **options)
    out = []
    for i in range(depth):
        base = net[i].weight.detach()
        members = bnn.model[i].member_weight.detach()
        out.append(float((members / base - 1).std()))
    return out


def test_init_noise_is_the_whole_networks_whatever_the_depth() -> None:
    # per_network (default): every layer's jitter is init_noise / √L, so L independent
    # jitters move the function like one layer of init_noise
    for depth in (1, 4, 16):
        for got in _relative_jitter(depth):
            assert abs(got - 0.05 / depth ** 0.5) < 0.1 * 0.05 / depth ** 0.5
    # per layer: init_noise on every layer
    for got in _relative_jitter(16, per_network=False):
        assert abs(got - 0.05) < 0.005


def test_per_network_jitter_keeps_a_deep_network_function() -> None:
    # 24 layers of 5 per cent each move the output several times further than one layer
    # of 5 per cent; scaled per network, about as far
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    net = nn.Sequential(*layers)
    x = torch.randn(64, 32)
    with torch.no_grad():
        ref = net(x)

    def moved(**options) -> float:
        bnn = bayesify(net, method="ensemble", components=4, init_noise=0.05,
                       laplace_heads=False, **options)
        with torch.no_grad():
            members = bnn.predictor(temperature=1.0).predict(x).member_logits
        return float((members - ref).norm() / (ref.norm() * members.shape[0] ** 0.5))

    assert moved() < 0.5 * moved(per_network=False)
