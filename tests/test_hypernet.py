"""Bayes by Hypernet: the nearest-neighbour KL, initialisation, sampling layout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesify import BayesifyError, bayesify
from bayesify.methods.hypernet import HypernetLayer, nearest_neighbour_kl


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv(x))))
        return self.fc(h.mean((2, 3)))


def _tiny() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet().eval()


SMALL = {"hidden": (16, 32)}  # the default 64-256-512 generator is exercised by the ResNet test


def test_nearest_neighbour_kl_converges_to_analytic() -> None:
    """1-D estimator vs KL(N(0.5, 0.7²) ‖ N(0, 1)) averaged over 200 independent variables."""
    analytic = math.log(1 / 0.7) + (0.7**2 + 0.5**2) / 2 - 0.5
    gen = torch.Generator().manual_seed(0)
    errors = {}
    for n in (4, 64, 4096):
        q = 0.5 + 0.7 * torch.randn(n, 200, generator=gen, dtype=torch.float64)
        p = torch.randn(n, 200, generator=gen, dtype=torch.float64)
        errors[n] = abs(nearest_neighbour_kl(q, p).mean().item() - analytic)
    assert errors[4096] < 0.01
    assert errors[4096] < errors[4]
    # unequal n, m and identical distributions (KL = 0)
    q = torch.randn(3000, 100, generator=gen, dtype=torch.float64)
    p = torch.randn(500, 100, generator=gen, dtype=torch.float64)
    assert abs(nearest_neighbour_kl(q, p).mean().item()) < 0.02


def test_nearest_neighbour_kl_brute_force_and_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    got = nearest_neighbour_kl(q, p)
    d_qq = (q[:, None] - q[None]).abs() + torch.diag(torch.full((5,), float("inf"), dtype=torch.float64))[..., None]
    rho = d_qq.min(1).values
    nu = (q[:, None] - p[None]).abs().min(1).values
    ref = (nu.log() - rho.log()).mean(0) + math.log(4 / 4)
    torch.testing.assert_close(got, ref)
    got.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    with pytest.raises(BayesifyError):
        nearest_neighbour_kl(q[:1], p)


@pytest.mark.parametrize("parameterization", ["full", "slices", "rank1"])
def test_zero_noise_reproduces_base_network(parameterization: str) -> None:
    model = _tiny()
    x = torch.randn(5, 2, 6, 6)
    with torch.no_grad():
        expected = model(x)
        bnn = bayesify(model, "hypernet", noise_scale=0.0, parameterization=parameterization, **SMALL)
        bnn.train()
        logits, _ = bnn.training_forward(x, torch.zeros(5, dtype=torch.long))
        torch.testing.assert_close(logits, expected.repeat(bnn.method.config.samples, 1),
                                   rtol=1e-5, atol=1e-6)
        members = bnn.predictor(samples_per_component=3)(x).member_logits
        torch.testing.assert_close(members, expected.expand(3, -1, -1), rtol=1e-5, atol=1e-6)
        # with noise, the z = 0 network (deterministic mode) is still the base network at init
        noisy = bayesify(model, "hypernet", parameterization=parameterization, **SMALL).eval()
        with noisy.deterministic():
            torch.testing.assert_close(noisy(x), expected, rtol=1e-5, atol=1e-6)
        assert noisy.member_logits(x).std(0).mean() > 1e-4


def test_initial_spread_around_pretrained() -> None:
    model = _tiny()
    bnn = bayesify(model, "hypernet", parameterization="full", init_scale=0.1, **SMALL)
    layer = bnn.model.conv
    assert isinstance(layer, HypernetLayer) and layer.mode == "full"
    with torch.no_grad():
        w = layer.generate(torch.randn(4000, 8))["weight"]
    rel = (w - model.conv.weight) / model.conv.weight.abs().clamp_min(1e-3)
    assert 0.05 < rel.std().item() < 0.2  # ≈ init_scale
    auto = bayesify(model, "hypernet", full_max_weights=100, **SMALL)
    assert auto.model.conv.mode == "full" and auto.model.conv2.mode == "rank1"  # 72 vs 144 weights


def test_every_sample_counts_and_members_fixed() -> None:
    bnn = bayesify(_tiny(), "hypernet", samples=3, **SMALL)
    x, y = torch.randn(4, 2, 6, 6), torch.tensor([0, 1, 2, 0])
    bnn.train()
    logits, targets = bnn.training_forward(x, y)
    assert logits.shape == (12, 3) and torch.equal(targets, y.repeat(3))
    assert not torch.allclose(logits[:4], logits[4:8]) and not torch.allclose(logits[4:8], logits[8:])
    # the loss of the last sample alone reaches the generators (not only sample 0)
    F.cross_entropy(logits[8:], targets[8:]).backward()
    head = bnn.model.conv.generator.head.weight
    assert head.grad is not None and head.grad.abs().sum() > 0
    bnn.eval()
    full = bnn.member_logits(x, samples_per_component=5)
    torch.testing.assert_close(bnn.member_logits(x, samples_per_component=5, max_rows=8), full,
                               rtol=1e-5, atol=1e-6)


def test_shared_noise_feeds_every_layer() -> None:
    seen: dict[str, torch.Tensor] = {}
    bnn = bayesify(_tiny(), "hypernet", noise="shared", **SMALL)
    for name, layer in bnn.bayesian_layers().items():
        layer.generator.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, a[0]))
    bnn.train()
    bnn.training_forward(torch.randn(2, 2, 6, 6), torch.zeros(2, dtype=torch.long))
    first = seen["conv"]
    assert all(torch.equal(z, first) for z in seen.values())
    again = dict(seen)
    bnn.training_forward(torch.randn(2, 2, 6, 6), torch.zeros(2, dtype=torch.long))
    assert not torch.equal(seen["conv"], again["conv"])  # fresh noise every forward
    indep = bayesify(_tiny(), "hypernet", **SMALL)
    for name, layer in indep.bayesian_layers().items():
        layer.generator.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, a[0]))
    indep.train()
    indep.training_forward(torch.randn(2, 2, 6, 6), torch.zeros(2, dtype=torch.long))
    assert not torch.equal(seen["conv"], seen["fc"])


def test_kl_fresh_prior_samples_and_gradient() -> None:
    bnn = bayesify(_tiny(), "hypernet", prior="pretrained", prior_std=0.1, **SMALL)
    kl1, kl2 = bnn.kl(), bnn.kl()
    assert torch.isfinite(kl1) and kl1.item() != kl2.item()
    kl1.backward()
    assert all(p.grad is not None for p in bnn.model.conv.generator.head.parameters())


def test_bad_options() -> None:
    for opts in ({"kl_samples": 1}, {"noise": "both"}, {"parameterization": "lowrank"},
                 {"hidden": ()}, {"noise_scale": -1.0}):
        with pytest.raises(BayesifyError):
            bayesify(_tiny(), "hypernet", **opts)


@pytest.mark.parametrize("arch", ["timm_resnet18", "tv_resnet50"])
def test_resnets_train_a_step(arch: str) -> None:
    torch.manual_seed(0)
    if arch == "timm_resnet18":
        timm = pytest.importorskip("timm")
        model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    else:
        tv = pytest.importorskip("torchvision")
        model = tv.models.resnet50(weights=None, num_classes=10)
    bnn = bayesify(model.eval(), "hypernet")  # default 64-256-512 generators, auto → rank-1
    modes = [m.mode for m in bnn.bayesian_layers().values()]
    assert "rank1" in modes and set(modes) <= {"rank1", "full"}  # full only up to 4096 weights
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    opt = torch.optim.Adam(bnn.posterior_parameters(), lr=1e-4)
    bnn.train()
    logits, targets = bnn.training_forward(x, y)
    loss = F.cross_entropy(logits, targets) + bnn.kl() / 1000
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("parameterization", ["rank1", "slices"])
def test_export_matches_predictor(tmp_path, parameterization: str) -> None:
    bnn = bayesify(_tiny(), "hypernet", parameterization=parameterization, **SMALL).eval()
    x = torch.randn(3, 2, 6, 6)
    predictor = bnn.predictor(samples_per_component=3)
    predictor.export(tmp_path / "p.pt2", x)
    probs, _ = torch.export.load(tmp_path / "p.pt2").module()(x)
    torch.testing.assert_close(probs, predictor(x).probs, rtol=1e-5, atol=1e-6)
