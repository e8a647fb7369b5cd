"""Export of the families with their own predictive: Laplace (GLM), SWAG, deep ensembles.

Each exported artefact must reproduce the in-process predictor (probs and mutual
information, temperature ≠ 1) to 1e-5 on CPU, and the frozen pieces must be the
mathematically right ones (dense-covariance probit, per-member SWAG weights and
BatchNorm statistics, per-member ensemble weights).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit
from bayesify.data.digits import digits_loaders
from bayesify.data.models import DigitsCNN, train_map
from bayesify.methods.laplace import state as laplace_state
from bayesify.predict.export import build_exported_predictor, run_exported


@pytest.fixture(scope="module")
def small(digits):
    """A width-8 digits CNN trained briefly, and the loaders (fast fits)."""
    loaders = digits_loaders(digits, batch_size=64, seed=0)
    torch.manual_seed(0)
    net = train_map(DigitsCNN(digits.num_classes, width=8), loaders["train"], epochs=2, seed=0)
    # posterior fits on 256 training examples keep every test short
    x, y = digits.train.tensors[0][:256], digits.train.tensors[1][:256]
    return net, {"train": DataLoader(TensorDataset(x, y), batch_size=32)}


def _check_file(predictor, path, x, atol=1e-5):
    probs, epistemic = run_exported(path, x)
    reference = predictor(x)
    torch.testing.assert_close(probs, reference.probs, atol=atol, rtol=0)
    torch.testing.assert_close(epistemic, reference.epistemic, atol=atol, rtol=0)
    return reference


def _laplace(small, loader=None, **options):
    net, loaders = small
    bnn = bayesify(net, "laplace", prior_method="fixed", prior_precision=0.5, predict_samples=4,
                   **options)
    fit(bnn, loader or loaders["train"], progress=False)
    return bnn


# -- Laplace ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("structure", "link"), [
    ("kron", "probit"), ("kron", "mc"), ("diag", "bridge"), ("full", "probit"),
])
def test_laplace_last_layer_pt2_matches_in_process(small, digits, structure, link, tmp_path):
    bnn = _laplace(small, structure=structure, link=link)
    predictor = bnn.predictor(seed=3, temperature=0.7)
    info = predictor.export(tmp_path / "l.pt2", digits.val.tensors[0][:3])
    assert info["members"] == (4 if link == "mc" else 1) and info["max_abs_diff"] <= 1e-5
    reference = _check_file(predictor, tmp_path / "l.pt2", digits.test.tensors[0][:11])
    # MC: S frozen weight samples disagree; probit/bridge: the Gaussian over the logits has
    # an epistemic part (entropy of the link minus the expected entropy of its draws)
    assert reference.epistemic.min() > 1e-4


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_laplace_every_link_of_the_exported_module_matches(small, digits, structure):
    """All structure × link pairs in memory (the traced pairs are above and below)."""
    x = digits.test.tensors[0][:9]
    for link in ("probit", "bridge", "mc"):
        predictor = _laplace(small, structure=structure, link=link).predictor(seed=1,
                                                                              temperature=1.4)
        with torch.no_grad():
            probs, epistemic = build_exported_predictor(predictor, x[:2])(x)
        reference = predictor(x)
        torch.testing.assert_close(probs, reference.probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(epistemic, reference.epistemic, atol=1e-5, rtol=0)


def test_laplace_probit_equals_dense_covariance_closed_form(small, digits):
    """probs = softmax(log softmax(f* / sqrt(1 + π/8 diag J Σ Jᵀ)) / T) with Σ = (G⊗A/N + τI)⁻¹
    built densely: the temperature acts on the probit predictive's log-probabilities."""
    bnn = _laplace(small, structure="kron", link="probit")
    predictor = bnn.predictor(temperature=1.3)
    x = digits.test.tensors[0][:6]
    module = build_exported_predictor(predictor, x)
    with torch.no_grad():
        probs, epistemic = module(x)
        layer = laplace_state.layers(bnn)["fc"]
        net = bnn.unwrap().eval()
        a = net.features(x).double()
        feats = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)  # ã [B, D']
        tau = bnn.method.prior_precision(bnn).double()
        precision = bnn.method.posterior(bnn).precision(tau).double()
        cov = torch.linalg.inv(precision)
        c = layer.base_layer.out_features
        jac = torch.einsum("ck,bd->bckd", torch.eye(c, dtype=a.dtype), feats).reshape(6, c, -1)
        var = torch.einsum("bcp,pq,bcq->bc", jac, cov, jac)  # diag J Σ Jᵀ
        logits = net(x).double()
        probit = (logits / torch.sqrt(1 + math.pi / 8 * var)).log_softmax(-1)
        expected = (probit / 1.3).softmax(-1)
    torch.testing.assert_close(probs.double(), expected, atol=2e-5, rtol=0)
    assert epistemic.min() > 0


def test_laplace_onnx_full_bridge(small, digits, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    predictor = _laplace(small, structure="full", link="bridge").predictor(temperature=0.8)
    info = predictor.export(tmp_path / "l.onnx", digits.val.tensors[0][:3], format="onnx")
    assert info["max_abs_diff"] <= 1e-5
    _check_file(predictor, tmp_path / "l.onnx", digits.test.tensors[0][:9])


def test_laplace_subnetwork_is_refused_clearly(small, digits, tmp_path):
    x, y = digits.train.tensors[0][:32], digits.train.tensors[1][:32]
    bnn = _laplace(small, DataLoader(TensorDataset(x, y), batch_size=32), structure="diag",
                   targets="all")
    for fmt in ("pt2", "onnx"):
        with pytest.raises(BayesifyError, match="subnetwork .* cannot be exported"):
            bnn.predictor().export(tmp_path / f"s.{fmt}", digits.val.tensors[0][:2], format=fmt)
        assert not (tmp_path / f"s.{fmt}").exists()


def test_laplace_before_fit_exports_the_map_network(small, digits):
    net, _ = small
    bnn = bayesify(net, "laplace")
    x = digits.test.tensors[0][:5]
    probs, epistemic = build_exported_predictor(bnn.predictor(temperature=2.0), x)(x)
    torch.testing.assert_close(probs, (net(x) / 2.0).softmax(-1), atol=1e-6, rtol=0)
    assert epistemic.abs().max() < 1e-6


# -- SWAG ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swag_bnn(small):
    net, loaders = small
    bnn = bayesify(net, "swag", snapshot_every_steps=2, lr=0.02, max_rank=4, predict_samples=3)
    fit(bnn, loaders["train"], epochs=1, progress=False)
    return bnn


def test_swag_members_are_the_sampled_networks_with_their_batchnorm(swag_bnn, digits):
    bnn = swag_bnn
    predictor = bnn.predictor(seed=5)
    module = build_exported_predictor(predictor, digits.val.tensors[0][:2])
    nets = module.members.models
    assert len(nets) == 3
    bn_stats = bnn.method.member_batchnorm(bnn, 3, 5)
    for m, net in enumerate(nets):
        sample = bnn.method.sample(bnn, m, 5)
        torch.testing.assert_close(net.fc.weight, sample["fc.theta.weight"], atol=0, rtol=0)
        torch.testing.assert_close(net.features[0].weight, sample["features.0.theta.weight"],
                                   atol=0, rtol=0)
        torch.testing.assert_close(net.features[1].running_mean,
                                   bn_stats[m]["features.1.running_mean"], atol=0, rtol=0)
    # recomputed BatchNorm differs per sampled network (not the θ̄ statistics shared)
    assert not torch.equal(nets[0].features[4].running_var, nets[1].features[4].running_var)


def test_swag_pt2_matches_in_process(swag_bnn, digits, tmp_path):
    predictor = swag_bnn.predictor(seed=5, temperature=0.9)
    info = predictor.export(tmp_path / "s.pt2", digits.val.tensors[0][:2])
    assert info["members"] == 3 and info["max_abs_diff"] <= 1e-5
    x = digits.test.tensors[0][:13]
    reference = _check_file(predictor, tmp_path / "s.pt2", x)
    assert reference.epistemic.max() > 1e-5
    # another seed is another set of networks: the export really froze seed 5's
    other = swag_bnn.predictor(seed=6, temperature=0.9)(x)
    assert (other.probs - reference.probs).abs().max() > 1e-5


def test_swa_exports_one_network(small, digits):
    net, loaders = small
    bnn = bayesify(net, "swag", snapshot_every_steps=2, variant="swa")
    fit(bnn, loaders["train"], epochs=1, progress=False)
    predictor = bnn.predictor()
    x = digits.test.tensors[0][:4]
    module = build_exported_predictor(predictor, x)
    assert module.num_members == 1
    with torch.no_grad():
        probs, epistemic = module(x)
    torch.testing.assert_close(probs, predictor(x).probs, atol=1e-5, rtol=0)
    assert epistemic.abs().max() < 1e-6


# -- deep ensembles ----------------------------------------------------------------------------
def test_ensemble_pt2_and_onnx_match_in_process(small, digits, tmp_path):
    net, loaders = small
    bnn = bayesify(net, "ensemble", components=2, init_noise=0.1, per_member_bn=True,
                   head_init="random")
    fit(bnn, loaders["train"], epochs=1, progress=False)
    predictor = bnn.predictor(2, temperature=1.2)  # M = K·n = 4, members 2k, 2k+1 equal
    x = digits.val.tensors[0][:3]
    info = predictor.export(tmp_path / "e.pt2", x)
    assert info["members"] == 4 and info["max_abs_diff"] <= 1e-5
    graph = torch.export.load(tmp_path / "e.pt2").graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert not any("bincount" in t or "_local_scalar_dense" in t for t in targets)  # no routing
    reference = _check_file(predictor, tmp_path / "e.pt2", digits.test.tensors[0][:10])
    assert reference.epistemic.max() > 1e-4
    if pytest.importorskip("onnxruntime") and pytest.importorskip("onnxscript"):
        predictor.export(tmp_path / "e.onnx", x, format="onnx")
        _check_file(predictor, tmp_path / "e.onnx", digits.test.tensors[0][:10])


def test_ensemble_member_networks_carry_member_weights(small, digits):
    net, _ = small
    bnn = bayesify(net, "ensemble", components=2, per_member_bn=True)
    with torch.no_grad():  # give member 1 its own BN statistics
        bnn.model.features[1].member_running_mean[1].add_(0.3)
    x = digits.test.tensors[0][:5]
    members = build_exported_predictor(bnn.predictor(), x).members
    with torch.no_grad():
        exported = members(x)
        expected = bnn.member_logits(x, samples_per_component=1)
    torch.testing.assert_close(exported, expected, atol=1e-5, rtol=0)
    heads = bnn.model.fc.member_weight
    torch.testing.assert_close(members.models[1].fc.weight, heads[1], atol=0, rtol=0)
    assert not torch.equal(members.models[0].fc.weight, members.models[1].fc.weight)
