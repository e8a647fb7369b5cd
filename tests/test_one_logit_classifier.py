"""A binary classifier with one logit ``z`` (trained with BCE), given the two-class logits
``[0, z]`` through ``output_fn`` as bayesify's refusal of a ``[B, 1]`` output advises: every
family fits with its defaults, and ``laplace``'s default structure is the diagonal posterior
of that Linear through the model's Jacobian (its output is not the logits, so the last-layer
GLM cannot read them). Before, ``laplace`` with defaults failed on the first batch ("needs the
wrapped Linear to produce the model's logits … name the classifier in targets=[...]", which
was the classifier already). The curvature is the binary GGN, brute-forced."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit, list_methods


def _two_class(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros_like(z), z], -1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).float()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(100):
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(net(x).squeeze(-1), y).backward()
        opt.step()
    return net.eval()


def _loader(seed: int, n: int = 96) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()), batch_size=32)


def test_a_one_logit_output_is_refused_with_the_output_fn_that_works():
    with pytest.raises(BayesifyError, match="output_fn=lambda z: torch.cat"):
        fit(bayesify(_net(), "laplace"), _loader(0), progress=False)


@pytest.mark.parametrize("method", list_methods())
def test_every_family_fits_a_one_logit_classifier_with_defaults(method):
    net = _net()
    x = _loader(2).dataset.tensors[0]
    bnn = bayesify(net, method, output_fn=_two_class)
    fit(bnn, _loader(0), val_loader=_loader(1), epochs=1, progress=False, seed=0)
    probs = bnn.predictor(seed=0)(x).probs
    assert torch.isfinite(probs).all() and probs.shape == (len(x), 2)
    with torch.no_grad():
        base = _two_class(net(x)).argmax(-1)
    assert float((probs.argmax(-1) == base).float().mean()) >= 0.9


def test_laplace_on_a_one_logit_classifier_is_its_binary_ggn_diagonal():
    """``structure='auto'`` → diag; the curvature of ``[W | b]`` is
    ``Σ_i p_i (1 − p_i) [a_i; 1]²`` (the logistic Hessian), brute-forced."""
    from bayesify.methods.laplace import state

    net = _net()
    bnn = bayesify(net, "laplace", output_fn=_two_class)
    assert bnn.method.config.structure == "diag"
    train = _loader(0)
    fit(bnn, train, progress=False)
    (layer,) = state.layers(bnn).values()
    x = train.dataset.tensors[0]
    with torch.no_grad():
        a = net[:3](x).double()
        p = torch.sigmoid(net(x).double()).squeeze(-1)
    ab = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
    expected = (p * (1 - p)).view(-1, 1).mul(ab.pow(2)).sum(0)
    torch.testing.assert_close(layer.ggn_diag.double(), expected, rtol=1e-5, atol=1e-8)
    # kron asked for explicitly: refused on the first batch, with the structure that works
    with pytest.raises(BayesifyError, match="one-logit classifier.*structure='diag'"):
        fit(bayesify(net, "laplace", output_fn=_two_class, structure="kron"), train,
            progress=False)


def test_its_laplace_export_is_refused_with_a_family_that_exports(tmp_path):
    from bayesify.predict.export import export_predictor

    bnn = bayesify(_net(), "laplace", output_fn=_two_class)
    fit(bnn, _loader(0), progress=False)
    x = _loader(0).dataset.tensors[0][:4]
    with pytest.raises(BayesifyError, match="one-logit binary classifier.*'ensemble'"):
        export_predictor(bnn.predictor(), tmp_path / "p.pt2", x)
