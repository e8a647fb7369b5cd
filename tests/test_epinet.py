"""Epinet (Osband et al. 2023): the members against a brute force of
``base(x) + c·(σ_L(φ̃, z_m) + α·σ_P(φ̃, z_m))`` on a tiny net, the prior network never
trained and saved / exported exactly, members fixed by their index, one base forward per
batch, and the fallback when the logits are not the classifier's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit, load_posterior
from bayesify.methods.epinet.layers import index_vectors


class Tiny(nn.Module):
    def __init__(self, post: float = 1.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 5), nn.Tanh())
        self.fc = nn.Linear(5, 3)
        self.post = post

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(self.body(x))
        return out if self.post == 1.0 else out * self.post  # a step after the classifier


def tiny(post: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    return Tiny(post).eval()


def data(n: int = 32, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()), batch_size=8)


def brute_force(bnn, x: torch.Tensor, z: torch.Tensor, scale: float) -> torch.Tensor:
    """``[M, B, C]`` in float64, written out layer by layer."""
    net = bnn.unwrap().double()
    layer = bnn.bayesian_layers()["fc"]
    phi = net.body(x.double())
    phi_n = (phi - phi.mean(-1, keepdim=True)) / torch.sqrt(phi.var(-1, unbiased=False, keepdim=True) + 1e-5)
    out = []
    for zm in z.double():
        inp = torch.cat([phi_n, zm.expand(x.shape[0], -1)], -1)

        def mlp(params, h):
            for i, (w, b) in enumerate(params):
                h = h @ w.double().T + b.double()
                h = h.relu() if i < len(params) - 1 else h
            return h

        learned = mlp([(m.weight.detach(), m.bias.detach()) for m in layer.learner], inp)
        prior = mlp(layer.prior_parameters(), inp)
        g = (learned + layer.prior_scale * prior).view(x.shape[0], 3, -1)
        out.append(net.fc(phi) * bnn.unwrap().post + scale * (g @ zm))
    return torch.stack(out)


def test_members_equal_a_brute_force_and_are_fixed_by_their_index():
    bnn = bayesify(tiny(), "epinet", index_dim=4, hidden=(7, 5), prior_scale=0.7)
    with torch.no_grad():  # a trained learner (its last layer starts at zero)
        for m in bnn.bayesian_layers()["fc"].learner:
            m.weight.normal_(0, 0.3)
            m.bias.normal_(0, 0.1)
    bnn.eval()
    bnn.state.set("epinet_scale", 1.5)
    x = torch.randn(5, 6)
    with torch.no_grad():
        got = bnn.member_logits(x, samples_per_component=6, seed=11)
        z = index_vectors(11, 6, 4, torch.device("cpu"))
        torch.testing.assert_close(got.double(), brute_force(bnn, x, z, 1.5), atol=1e-5, rtol=1e-5)
        # member m is index (seed, m) whatever M: a prefix of a larger predictive
        more = bnn.member_logits(x, samples_per_component=9, seed=11)
        assert torch.equal(more[:6], got)
        assert not torch.allclose(bnn.member_logits(x, samples_per_component=6, seed=12), got)
        # deterministic: z = 0, the base network
        with bnn.deterministic():
            assert torch.equal(bnn(x), tiny()(x))


def test_one_base_forward_per_batch_and_the_fallback_gives_the_same_members():
    calls = []
    bnn = bayesify(tiny(), "epinet")
    bnn.model.body.register_forward_hook(lambda *a: calls.append(a[2].shape[0]))
    bnn.eval()
    x = torch.randn(4, 6)
    with torch.no_grad():
        members = bnn.member_logits(x, seed=2)
        assert calls == [4] and members.shape == (20, 4, 3)
        logits, targets = bnn.method.step().forward(bnn, x, torch.zeros(4, dtype=torch.long))
        assert calls == [4, 4] and logits.shape == (16, 3) and targets.shape == (16,)  # samples = 4 indices per example
    # logits = 2·fc(φ): the fast path does not apply; one forward per member, same maths
    post = bayesify(tiny(post=2.0), "epinet")
    post.load_state_dict(bnn.state_dict())
    post.eval()
    with torch.no_grad():
        got = post.member_logits(x, seed=2)
        z = index_vectors(2, 20, 8, torch.device("cpu"))
        want = brute_force(post, x, z, 1.0)  # post·(fc(φ) + σ) = post·fc(φ) + σ·post
        want = 2.0 * (want - post.unwrap().double()(x.double())) + post.unwrap().double()(x.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_prior_network_is_never_trained_and_saved_exactly(tmp_path):
    net = tiny()
    bnn = bayesify(net, "epinet")
    layer = bnn.bayesian_layers()["fc"]
    prior = {n: b.clone() for n, b in layer.named_buffers() if n.startswith("prior_")}
    assert prior and not any(b.requires_grad for b in prior.values())
    assert not any(n.startswith("prior_") for n, _ in layer.named_parameters())
    learner = [p.clone() for p in layer.learner.parameters()]
    fit(bnn, data(), epochs=2, progress=False, seed=0)
    now = dict(layer.named_buffers())
    assert all(torch.equal(now[n], b) for n, b in prior.items())
    assert any(not torch.equal(a, b) for a, b in zip(learner, layer.learner.parameters()))
    # saved exactly: a modified prior comes back as it was saved, not re-drawn from its seed
    with torch.no_grad():
        layer.prior_w0.add_(0.25)
    saved = layer.prior_w0.clone()
    bnn.save_posterior(tmp_path / "p")
    again = load_posterior(tiny(), tmp_path / "p")
    assert torch.equal(again.bayesian_layers()["fc"].prior_w0, saved)
    x = torch.randn(6, 6)
    assert torch.equal(again.predictor(seed=1)(x).probs, bnn.predictor(seed=1)(x).probs)


@pytest.mark.slow  # ~40 s (torch.export + ONNX); the default run exports epinet in test_export_architectures
@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_export_equals_in_process_with_the_prior_frozen_exactly(fmt, tmp_path):
    from bayesify.predict.export import build_exported_predictor, run_exported

    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    bnn = bayesify(tiny(), "epinet", predict_samples=5)
    fit(bnn, data(), epochs=1, progress=False, seed=0)
    bnn.eval()
    bnn.state.set("epinet_scale", 0.75)
    predictor = bnn.predictor(seed=3, temperature=1.2)
    x = torch.randn(9, 6)
    module = build_exported_predictor(predictor, x[:2])
    layer = bnn.bayesian_layers()["fc"]
    frozen = dict(module.named_buffers())
    for name, value in layer.named_buffers():
        if name.startswith("prior_"):
            assert torch.equal(frozen[f"members.model.fc.{name}"], value)
    info = predictor.export(tmp_path / f"e.{fmt}", x[:2], format=fmt)
    assert info["members"] == 5 and info["max_abs_diff"] <= 1e-5
    probs, epistemic = run_exported(tmp_path / f"e.{fmt}", x)
    reference = predictor(x)
    torch.testing.assert_close(probs, reference.probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(epistemic, reference.epistemic, atol=1e-5, rtol=0)


def test_one_classifier_only():
    from bayesify import BayesifyError

    with pytest.raises(BayesifyError, match="one classifier"):
        bayesify(tiny(), "epinet", targets="all")
