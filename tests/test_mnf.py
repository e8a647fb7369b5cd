"""MNF (multiplicative normalizing flows): the mathematics of the family.

* the flow: exact identity at init, log-determinant equal to autograd's Jacobian;
* the prior: the closed-form ``KL(q(W|z)‖p(W))`` against a Monte-Carlo estimate with
  ``torch.distributions`` densities (rank-one-plus-diagonal Gaussian per node);
* the auxiliary bound: the layer's KL term (closed-form parts, and for the 'node' inverse
  model the expectation over W in closed form) against a brute-force Monte-Carlo estimate
  that samples z_0, pushes it through the flows with autograd's Jacobian, samples the
  whole W and evaluates every density explicitly, for both inverse models;
* depth 0 and no weight noise: exactly iBNN with ``components=1`` (same logits, KL, loss
  and gradients on the same batch and noise);
* zero noise: ``deterministic()`` and the knob at 0 are the pretrained network;
* the knob, export (pt2 and ONNX) and save/load.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import LowRankMultivariateNormal, Normal

from bayesify import BayesifyError, bayesify, fit, load_posterior
from bayesify.core.context import SamplingContext
from bayesify.methods.mnf import CouplingFlow, MNFConfig, MNFLayer, node_prior_kl, node_view
from bayesify.predict.export import build_exported_predictor, run_exported

KNOB = "mnf_noise_scale"


def _cnn(classes: int = 4) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 6, 3, padding=1, groups=2), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, classes)).eval()


def _randomise(module: nn.Module, scale: float = 0.3, seed: int = 5) -> None:
    """Non-trivial values for every posterior tensor (flows away from the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not name.startswith("base_layer."):
                p.add_(scale * torch.randn(p.shape, generator=gen))


def _layer(base: nn.Module, **options) -> MNFLayer:
    return MNFLayer(base, context=SamplingContext(1), config=MNFConfig(**options))


# -- the flow ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 2, 7])
def test_flow_is_identity_at_init_and_its_logdet_is_the_jacobians(dim):
    torch.manual_seed(0)
    flow = CouplingFlow(dim, depth=3, hidden=8, scale=0.05)
    z = 1 + 0.05 * torch.randn(5, dim)
    out, logdet = flow(z)
    torch.testing.assert_close(out, z, rtol=0, atol=1e-7)
    assert torch.equal(logdet, torch.zeros(5))
    _randomise(flow, scale=0.5)
    out, logdet = flow(z)
    assert (out - z).abs().max() > 1e-3  # the randomised flow moves z
    for r in range(z.shape[0]):
        jac = torch.autograd.functional.jacobian(lambda v: flow(v[None])[0][0], z[r])
        torch.testing.assert_close(logdet[r], torch.linalg.slogdet(jac)[1], rtol=1e-5, atol=1e-5)


# -- the prior --------------------------------------------------------------------------------
def test_node_view_groups_every_weight_reading_an_input_channel():
    conv = nn.Conv2d(4, 6, 3, groups=2)
    view = node_view(conv.weight, groups=2)  # [in, fan_out]
    assert view.shape == (4, 3 * 9)
    # input channel 3 is channel 1 of group 1: out channels 3..5
    torch.testing.assert_close(view[3], conv.weight[3:6, 1].reshape(-1))
    lin = nn.Linear(3, 5)
    torch.testing.assert_close(node_view(lin.weight), lin.weight.t())


def test_node_prior_kl_matches_monte_carlo_of_the_densities():
    gen = torch.Generator().manual_seed(0)
    c, n, s, jitter, floor = 3, 5, 0.2, 0.1, 1e-3
    w = 0.3 * torch.randn(c, n, generator=gen, dtype=torch.float64)
    w[0, 0] = 0.0  # a zero weight: the floor
    std = 0.05 * torch.rand(c, n, generator=gen, dtype=torch.float64) + 0.01
    z = 1 + 0.2 * torch.randn(c, generator=gen, dtype=torch.float64)
    closed = node_prior_kl(w, std, z, scale=s, jitter=jitter, floor=floor)
    d = jitter * w.abs().clamp_min(floor)
    prior = LowRankMultivariateNormal(w, s * w.unsqueeze(-1), d.pow(2))
    q = Normal(z[:, None] * w, std)
    samples = q.sample((200_000,))
    terms = q.log_prob(samples).sum(-1) - prior.log_prob(samples)  # [S, C]
    mc, se = terms.sum(-1).mean(), terms.sum(-1).std() / math.sqrt(samples.shape[0])
    assert abs(float(closed - mc)) < 4 * float(se) + 1e-3, (float(closed), float(mc), float(se))


# -- the auxiliary bound ----------------------------------------------------------------------
def brute_force_kl_terms(layer: MNFLayer, draws: int) -> torch.Tensor:
    """``[draws]`` samples of ``log q(z_T) + log q(W|z_T) − log p(W) − log r(z_T|W)`` from
    scratch: z_0 sampled, the flows' log|det| from autograd's Jacobian, the whole W sampled,
    every density from ``torch.distributions`` or written out."""
    def jacobian_logdet(flow, points):
        jac = torch.func.vmap(torch.func.jacrev(lambda v: flow(v[None])[0][0]))(points)
        return torch.linalg.slogdet(jac)[1]

    with torch.no_grad():
        mu, std = layer.z_mean, layer.z_std
        z0 = mu + std * torch.randn(draws, mu.shape[0])
        z = layer.flow(z0)[0]                                                 # [S, C]
        log_q_z = Normal(mu, std).log_prob(z0).sum(-1) - jacobian_logdet(layer.flow, z0)
        w = node_view(layer.base_layer.weight, layer.groups)                  # [C, n]
        sigma = node_view(layer.weight_sigma, layer.groups)
        q_w = Normal(z[..., None] * w, sigma)
        weights = q_w.sample()                                                # [S, C, n]
        d = layer.prior_weight_std * w.abs().clamp_min(layer.floor)
        prior = LowRankMultivariateNormal(w, layer.prior_std * w.unsqueeze(-1), d.pow(2))
        log_q_w, log_p_w = q_w.log_prob(weights).sum((-1, -2)), prior.log_prob(weights).sum(-1)
        r = layer.inverse
        if r.use_nodes:  # the posterior of z_i given a_i = ⟨W_i, w_i⟩/‖w_i‖², from W itself
            prior = torch.exp(-2 * r.log_std)
            stat = (weights * w).sum(-1) / w.pow(2).sum(-1)
            v = (w.pow(2) * sigma.pow(2)).sum(-1) / w.pow(2).sum(-1).pow(2)
            total = prior + 1 / v
            mean, var = (prior * r.m + stat / v) / total, 1 / total
        else:  # eq. 11–12
            g = torch.tanh(torch.einsum("c,scn->sn", r.c, weights)).mean(-1, keepdim=True)
            mean, var = r.m + r.b1 * g, torch.exp(2 * (r.log_std + r.b2 * g))
        log_r = Normal(mean, var.sqrt()).log_prob(r.flow(z)[0]).sum(-1) + jacobian_logdet(r.flow, z)
    return log_q_z + log_q_w - log_p_w - log_r


@pytest.mark.parametrize("inverse", ["node", "paper"])
@pytest.mark.parametrize("shape", ["linear", "grouped_conv"])
def test_auxiliary_bound_kl_term_matches_a_brute_force_monte_carlo_estimate(shape, inverse):
    torch.manual_seed(0)
    base = nn.Linear(5, 3) if shape == "linear" else nn.Conv2d(4, 2, 2, groups=2)
    layer = _layer(base, flow_depth=2, inverse_flow_depth=1, flow_hidden=6, init_std=0.1,
                   weight_std=0.2, prior_weight_std=0.15, prior_std=0.3, inverse_model=inverse)
    _randomise(layer, scale=0.2)
    with torch.no_grad():  # σ around the prior's jitter: every log-ratio is O(1)
        w = layer.base_layer.weight
        sigma = 0.15 * w.abs().clamp_min(1e-3) * (0.7 + 0.6 * torch.rand_like(w))
        layer.weight_rho.copy_(torch.log(torch.expm1(sigma)))
    draws, reference_draws = 3000, 30_000  # the brute force is vectorised: cheap
    with torch.no_grad():
        torch.manual_seed(1)
        ours = torch.stack([layer.kl() for _ in range(draws)])
    torch.manual_seed(2)
    reference = brute_force_kl_terms(layer, reference_draws)
    se = math.sqrt(ours.var() / draws + reference.var() / reference_draws)
    gap = float(ours.mean() - reference.mean())
    assert abs(gap) < 4 * se, (float(ours.mean()), float(reference.mean()), se)
    assert se < 0.05 * abs(float(reference.mean()))  # the check has power (means 8–28 nats)


# -- depth 0 = iBNN with one component ---------------------------------------------------------
def test_depth_zero_without_weight_noise_is_ibnn_with_one_component():
    """flow_depth=0, weight_std=0: q(z) = N(μ_z, σ_z²) per input node, W = diag(z)·w, KL =
    KL(q(z)‖N(1, s²)) — iBNN's node noise, mixture and KL with K = 1 and prior N(1, s²) per
    node (``per_network=False``)."""
    net = _cnn()
    ibnn = bayesify(net, "ibnn", components=1, samples=2, prior_std=0.1, init_mean_std=0.0,
                    per_network=False)  # MNF's prior is per node
    mnf = bayesify(net, "mnf", flow_depth=0, weight_std=0.0, samples=2, prior_std=0.1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for (_, a), (_, b) in zip(ibnn.bayesian_layers().items(), mnf.bayesian_layers().items()):
            a.mean.add_(0.2 * torch.randn(a.mean.shape, generator=gen))
            a.rho.add_(0.5 * torch.randn(a.rho.shape, generator=gen))
            b.z_mean.copy_(a.mean[0])
            b.z_rho.copy_(a.rho[0])
    x, y = torch.randn(5, 2, 6, 6), torch.tensor([0, 1, 2, 3, 0])

    def loss(bnn):
        bnn.train()
        torch.manual_seed(11)
        logits, targets = bnn.training_forward(x, y)
        kl = bnn.kl()
        total = F.cross_entropy(logits, targets) + kl / 100
        total.backward()
        return logits, kl, total

    logits_i, kl_i, loss_i = loss(ibnn)
    logits_m, kl_m, loss_m = loss(mnf)
    assert torch.equal(logits_m, logits_i)
    # iBNN sums its KL over all layers' nodes at once (NodeNoiseLayer.kl_many), MNF layer by
    # layer: the same sum in another order
    torch.testing.assert_close(kl_m, kl_i, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss_m, loss_i, rtol=1e-6, atol=0)
    for a, b in zip(ibnn.bayesian_layers().values(), mnf.bayesian_layers().values()):
        torch.testing.assert_close(b.z_mean.grad, a.mean.grad[0], rtol=1e-6, atol=0)
        torch.testing.assert_close(b.z_rho.grad, a.rho.grad[0], rtol=1e-6, atol=0)
    # a flow of depth 1 (even at its identity init, its KL is a Monte-Carlo one) breaks it
    other = bayesify(net, "mnf", flow_depth=1, weight_std=0.0, samples=2, prior_std=0.1)
    assert not torch.equal(loss(other)[1], kl_i)


# -- zero noise ---------------------------------------------------------------------------------
def test_deterministic_and_knob_zero_are_the_pretrained_network():
    net = _cnn()
    x = torch.randn(3, 2, 6, 6)
    bnn = bayesify(net, "mnf")
    with torch.no_grad():
        expected = net(x)
        with bnn.deterministic():
            assert torch.equal(bnn.eval()(x), expected)
        bnn.state.set(KNOB, 0.0)
        members = bnn.predictor(seed=0)(x).member_logits
    assert members.shape[0] == 10
    torch.testing.assert_close(members, expected.expand_as(members), rtol=0, atol=1e-6)


def test_knob_changes_prediction_and_survives_save_load_and_export(tmp_path):
    net = _cnn()
    x = torch.randn(6, 2, 6, 6)
    bnn = bayesify(net, "mnf").eval()
    with torch.no_grad():
        at_one = bnn.predictor(seed=3)(x).probs
        bnn.state.set(KNOB, 0.5)
        tuned = bnn.predictor(seed=3)(x)
    assert not torch.allclose(at_one, tuned.probs, atol=1e-6)
    bnn.save_posterior(tmp_path / "post")
    loaded = load_posterior(net, tmp_path / "post")
    assert loaded.state.value(KNOB) == 0.5
    with torch.no_grad():
        assert torch.equal(loaded.predictor(seed=3)(x).probs, tuned.probs)
    for fmt in ("pt2", "onnx"):
        path = tmp_path / f"mnf.{fmt}"
        info = bnn.predictor(seed=3).export(path, x[:2])
        probs, epistemic = run_exported(path, x)
        torch.testing.assert_close(probs, tuned.probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(epistemic, tuned.epistemic, rtol=0, atol=1e-5)
        assert info["members"] == 10


def test_fit_trains_the_flow_and_reloads_exactly(tmp_path):
    torch.manual_seed(0)
    net = _cnn()
    data = torch.utils.data.TensorDataset(torch.randn(64, 2, 6, 6), torch.randint(0, 4, (64,)))
    bnn = bayesify(net, "mnf")
    fit(bnn, torch.utils.data.DataLoader(data, batch_size=16), epochs=2, progress=False, seed=0)
    layer = next(iter(bnn.bayesian_layers().values()))
    assert layer.flow.layers[0].heads.weight.abs().sum() > 0  # the flow left the identity
    x = torch.randn(4, 2, 6, 6)
    bnn.save_posterior(tmp_path / "post")
    loaded = load_posterior(net, tmp_path / "post")
    with torch.no_grad():
        assert torch.equal(loaded.predictor(seed=1)(x).member_logits,
                           bnn.predictor(seed=1)(x).member_logits)
        exported, _ = build_exported_predictor(bnn.predictor(seed=1), x[:2])(x)
    torch.testing.assert_close(exported, bnn.predictor(seed=1)(x).probs, rtol=0, atol=1e-5)


def test_flow_runs_in_fp32_under_autocast():
    layer = _layer(nn.Linear(4, 3))
    _randomise(layer)
    layer.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = layer.node_noise(5, torch.device("cpu"))
        out = layer(torch.randn(5, 4))
    assert z.dtype == torch.float32 and torch.isfinite(out).all()


# -- configuration -----------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    ({"flow_depth": -1}, "flow_depth must be an integer >= 0"),
    ({"inverse_model": "exact"}, "inverse_model must be one of"),
    ({"weight_std": -0.1}, "weight_std must be >= 0"),
    ({"init_std": 0.0}, "init_std must be > 0"),
    ({"prior_weight_std": 0.0}, "prior_weight_std must be > 0"),
])
def test_bad_options_name_what_was_wrong(options, message):
    with pytest.raises(BayesifyError, match=message):
        bayesify(_cnn(), "mnf", **options)


def test_same_padding_with_reflection_is_refused_before_anything_changes():
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding="same", padding_mode="reflect"), nn.Flatten(),
                        nn.Linear(3 * 16, 2))
    with pytest.raises(BayesifyError, match="padding='same'.*exclude"):
        bayesify(net, "mnf")
    assert isinstance(net[0], nn.Conv2d)
    assert bayesify(net, "mnf", weight_std=0.0).bayesian_layers()  # node noise only: fine
