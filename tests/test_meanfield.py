"""Mean-field (Bayes by Backprop): KL, priors, estimators, pruning, KL weighting."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesify import BayesifyError, bayesify
from bayesify.methods.meanfield import (
    MeanFieldLayer,
    WeightPrior,
    blundell_log_weight,
    gaussian_kl,
    magnitude_prune,
    minibatch_kl_weight,
    scale_mixture_log_prob,
    snr_prune,
)
from bayesify.methods.meanfield.pruning import signal_to_noise


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _tiny() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet().eval()


def test_analytic_gaussian_kl_matches_monte_carlo() -> None:
    gen = torch.Generator().manual_seed(0)
    mu = torch.tensor([0.3, -1.0, 0.05], dtype=torch.float64)
    std = torch.tensor([0.2, 0.5, 0.01], dtype=torch.float64)
    centre = torch.tensor([0.1, -0.5, 0.0], dtype=torch.float64)
    for prior in (WeightPrior("gaussian", std=0.7), WeightPrior("pretrained", std=0.3)):
        analytic = prior.kl(mu, std, centre)
        w = mu + std * torch.randn(400_000, 3, generator=gen, dtype=torch.float64)
        log_q = -0.5 * ((w - mu) / std) ** 2 - std.log() - 0.5 * math.log(2 * math.pi)
        mc = (log_q - prior.log_prob(w, centre)).mean(0).sum()
        se = (log_q - prior.log_prob(w, centre)).sum(1).std() / math.sqrt(w.shape[0])
        assert abs(analytic.item() - mc.item()) < 5 * se.item() + 1e-4, (prior.kind, analytic, mc)
    # the direction is KL(q‖p): a narrow q inside a wide p costs log(σp/σq) − ½ + …
    kl = gaussian_kl(torch.tensor(0.0), torch.tensor(0.1), 0.0, 1.0)
    assert kl.item() == pytest.approx(math.log(10.0) + 0.5 * 0.01 - 0.5, rel=1e-6)


def test_scale_mixture_log_prob_matches_direct_computation() -> None:
    pi, s1, s2 = 0.25, 1.0, math.exp(-6)
    w = torch.tensor([0.0, 1e-4, 2.5e-3, 0.05, -0.3, 2.0, -7.0], dtype=torch.float64)

    def normal_pdf(x: float, s: float) -> float:
        return math.exp(-0.5 * (x / s) ** 2) / (s * math.sqrt(2 * math.pi))

    direct = [math.log(pi * normal_pdf(v, s1) + (1 - pi) * normal_pdf(v, s2)) for v in w.tolist()]
    got = scale_mixture_log_prob(w, pi, s1, s2)
    torch.testing.assert_close(got, torch.tensor(direct, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    # far in the tail the naive sum underflows for the narrow part; logsumexp stays finite
    assert torch.isfinite(scale_mixture_log_prob(torch.tensor([50.0]), pi, s1, s2)).all()
    # the layer's MC KL for the mixture prior is log q − log p summed over every weight
    layer = bayesify(_tiny(), "meanfield", prior="scale_mixture", mixture_pi=pi).model.fc
    torch.manual_seed(5)
    kl = layer.kl()
    torch.manual_seed(5)
    w_s = layer.weight_mu + layer.weight_std * torch.randn_like(layer.weight_mu)
    b_s = layer.bias_mu + layer.bias_std * torch.randn_like(layer.bias_mu)
    ref = sum(
        (-0.5 * ((v - m) / s) ** 2 - s.log() - 0.5 * math.log(2 * math.pi)
         - scale_mixture_log_prob(v, pi, s1, s2)).sum()
        for v, m, s in ((w_s, layer.weight_mu, layer.weight_std), (b_s, layer.bias_mu, layer.bias_std))
    )
    torch.testing.assert_close(kl, ref)


def test_init_at_pretrained_and_kl_summed() -> None:
    model = _tiny()
    bnn = bayesify(model, "meanfield", delta=0.1, prior="pretrained", prior_std=0.05)
    layer = bnn.model.conv
    assert isinstance(layer, MeanFieldLayer)
    assert torch.equal(layer.weight_mu, model.conv.weight)
    torch.testing.assert_close(layer.weight_std, 0.1 * model.conv.weight.abs().clamp_min(1e-3))
    # per_network: δ is the network's, δ/√L per layer of L wrapped layers
    depth = len(bnn.bayesian_layers())
    assert depth > 1
    whole = bayesify(_tiny(), "meanfield", delta=0.1, per_network=True).model.conv
    torch.testing.assert_close(whole.weight_std,
                               0.1 / depth**0.5 * model.conv.weight.abs().clamp_min(1e-3))
    # the base weights are not posterior parameters and stay frozen
    names = [n for n, _ in bnn.named_posterior_parameters()]
    assert "conv.weight_mu" in names and not any(n.endswith(".weight") for n in names)
    assert not model.conv.weight.requires_grad or all(not p.requires_grad for p in bnn.base_parameters())
    # summed (never averaged) over all weights and layers: matches the elementwise closed form
    expected = sum(
        gaussian_kl(m.weight_mu, m.weight_std, m.base_layer.weight, 0.05).sum()
        + gaussian_kl(m.bias_mu, m.bias_std, m.base_layer.bias, 0.05).sum()
        for m in bnn.bayesian_layers().values()
    )
    torch.testing.assert_close(bnn.kl(), expected)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_local_reparam_matches_weight_sampling(kind: str) -> None:
    """Per-unit output mean/variance: local reparam = weight sampling = closed form."""
    torch.manual_seed(0)
    base = nn.Linear(5, 3) if kind == "linear" else nn.Conv2d(2, 3, 3, padding=1)
    x1 = torch.randn(1, 5) if kind == "linear" else torch.randn(1, 2, 4, 4)
    rows = 6000
    results = {}
    for sampling in ("local_reparam", "weights", "flipout"):
        bnn = bayesify(nn.Sequential(base), "meanfield", sampling=sampling, delta=0.5).train()
        layer = bnn.model[0]
        gen = torch.Generator().manual_seed(11)
        member = torch.arange(rows)
        with torch.no_grad():
            if sampling == "flipout":  # one ΔW per forward: many small forwards
                outs = []
                for _ in range(rows // 4):
                    with bnn.context.use(torch.zeros(4, dtype=torch.long), generator=gen):
                        outs.append(bnn(x1.expand(4, *x1.shape[1:])))
                out = torch.cat(outs)
            else:
                plan = {"member": member, "num_members": rows} if sampling == "weights" else {}
                with bnn.context.use(torch.zeros(rows, dtype=torch.long), generator=gen, **plan):
                    out = bnn(x1.expand(rows, *x1.shape[1:]))
            mean = F.linear(x1, layer.weight_mu, layer.bias_mu) if kind == "linear" else \
                F.conv2d(x1, layer.weight_mu, layer.bias_mu, padding=1)
            var = (F.linear(x1**2, layer.weight_std**2, layer.bias_std**2) if kind == "linear" else
                   F.conv2d(x1**2, layer.weight_std**2, layer.bias_std**2, padding=1))
        results[sampling] = out
        se_mean = (var / rows).sqrt()
        assert ((out.mean(0) - mean[0]).abs() <= 5 * se_mean[0] + 1e-6).all(), sampling
        # variance of a sample variance: 2σ⁴/(n−1) for Gaussian outputs
        se_var = var * math.sqrt(2.0 / (rows - 1))
        assert ((out.var(0) - var[0]).abs() <= 5 * se_var[0] + 1e-6).all(), sampling
    assert not torch.allclose(results["local_reparam"], results["weights"])


def test_tiny_delta_reproduces_base_network() -> None:
    model = _tiny()
    x = torch.randn(7, 2, 4, 4)
    with torch.no_grad():
        expected = model(x)
        for sampling in ("local_reparam", "flipout", "weights"):
            bnn = bayesify(model, "meanfield", delta=1e-7, init_floor=1e-7, sampling=sampling)
            bnn.train()
            logits, _ = bnn.training_forward(x, torch.zeros(7, dtype=torch.long))
            torch.testing.assert_close(logits[:7], expected, rtol=1e-4, atol=1e-5)
            members = bnn.predictor(samples_per_component=3)(x).member_logits
            torch.testing.assert_close(members, expected.expand(3, -1, -1), rtol=1e-4, atol=1e-5)
            with bnn.deterministic():
                assert torch.equal(bnn.eval()(x), expected)  # μ = w exactly


def test_weight_members_fixed_and_chunk_independent() -> None:
    bnn = bayesify(_tiny(), "meanfield", sampling="weights", samples=3, delta=0.3).eval()
    x = torch.randn(4, 2, 4, 4)
    full = bnn.member_logits(x, samples_per_component=6)
    chunked = bnn.member_logits(x, samples_per_component=6, max_rows=8)  # 2 members per chunk
    torch.testing.assert_close(full, chunked, rtol=1e-5, atol=1e-6)
    assert full.std(0).mean() > 1e-3  # members differ
    # training: every repeat is its own weight sample (blocks of the same inputs differ)
    bnn.train()
    logits, targets = bnn.training_forward(x, torch.arange(4))
    assert logits.shape == (12, 4) and torch.equal(targets, torch.arange(4).repeat(3))
    assert not torch.allclose(logits[:4], logits[4:8])


def test_blundell_kl_weighting() -> None:
    for m in (1, 3, 10):
        naive = [2.0 ** (m - i) / (2.0**m - 1) for i in range(1, m + 1)]
        got = [math.exp(blundell_log_weight(s, m)) for s in range(m)]
        assert got == pytest.approx(naive, rel=1e-12)
        # as a multiplier of KL/N_train it averages to 1 over the epoch (= uniform)
        mult = [minibatch_kl_weight(s, m, "blundell") for s in range(m)]
        assert sum(mult) / m == pytest.approx(1.0, rel=1e-12)
    big = [minibatch_kl_weight(s, 5000, "blundell") for s in (0, 1, 4999)]
    assert all(math.isfinite(v) for v in big) and big[0] == pytest.approx(2500.0) and big[2] == 0.0
    assert minibatch_kl_weight(7, 10, "uniform") == 1.0
    bnn = bayesify(_tiny(), "meanfield", kl_weighting="blundell")
    assert bnn.method.kl_weight(0, 4) == pytest.approx(4 * 8 / 15)


def test_snr_and_magnitude_pruning() -> None:
    bnn = bayesify(_tiny(), "meanfield", delta=0.1)
    with torch.no_grad():  # make σ differ from δ|w| so SNR ≠ magnitude ordering
        for layer in bnn.bayesian_layers().values():
            layer.weight_rho.add_(torch.randn_like(layer.weight_rho))
    layers = bnn.bayesian_layers()
    snr = torch.cat([signal_to_noise(m).flatten() for m in layers.values()])
    result = snr_prune(bnn, 0.3)
    assert result.pruned == round(0.3 * snr.numel()) and result.total == snr.numel()
    kept = torch.cat([result.masks[n].flatten() for n in layers])
    assert snr[~kept].max() <= snr[kept].min()
    for name, layer in layers.items():
        assert (layer.weight_mu[~result.masks[name]] == 0).all()
        assert (layer.weight_std[~result.masks[name]] < 1e-12).all()
    mag_bnn = bayesify(_tiny(), "meanfield")
    mags = torch.cat([m.weight_mu.abs().flatten() for m in mag_bnn.bayesian_layers().values()])
    mag = magnitude_prune(mag_bnn, 0.5)
    kept = torch.cat([mag.masks[n].flatten() for n in mag_bnn.bayesian_layers()])
    assert mags[~kept].max() <= mags[kept].min()
    with pytest.raises(BayesifyError):
        snr_prune(bnn, 1.5)
    with pytest.raises(BayesifyError):
        snr_prune(bayesify(_tiny(), "ibnn"), 0.1)


def test_bad_options() -> None:
    for opts in ({"delta": 0.0}, {"prior": "laplace"}, {"sampling": "mc"}, {"kl_weighting": "x"},
                 {"mixture_pi": 1.5}, {"predict_sampling": "flipout"}):
        with pytest.raises(BayesifyError):
            bayesify(_tiny(), "meanfield", **opts)


def test_timm_resnet18_trains_a_step() -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).eval()
    bnn = bayesify(model, "meanfield")
    assert len(bnn.bayesian_layers()) == 21  # 20 convs + fc
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    opt = torch.optim.Adam(bnn.posterior_parameters(), lr=1e-3)
    bnn.train()
    logits, targets = bnn.training_forward(x, y)
    loss = F.cross_entropy(logits, targets) + bnn.kl() / 1000
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert bnn.predictor(samples_per_component=2)(x).probs.shape == (2, 10)


@pytest.mark.parametrize("predict_sampling", ["weights", "local_reparam"])
def test_export_matches_predictor(tmp_path, predict_sampling: str) -> None:
    bnn = bayesify(_tiny(), "meanfield", delta=0.3, predict_sampling=predict_sampling).eval()
    x = torch.randn(3, 2, 4, 4)
    predictor = bnn.predictor(samples_per_component=3)
    predictor.export(tmp_path / "p.pt2", x)
    probs, _ = torch.export.load(tmp_path / "p.pt2").module()(x)
    torch.testing.assert_close(probs, predictor(x).probs, rtol=1e-5, atol=1e-6)
    assert predictor(x).epistemic.mean() > 0
