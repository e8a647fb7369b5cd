"""Laplace on a network that ends in ``log_softmax`` (PyTorch's classic MNIST example, with
``nll_loss``): log-probabilities are valid logits — they differ from the classifier's output
by a constant per row, which no softmax sees.

Found probing first-hour models (thirty-third stop): ``laplace`` with every default failed on
the first batch ("last-layer Laplace needs the wrapped Linear to produce the model's
logits"), as its check asked for the classifier's output to *equal* the logits. The check now
asks for the same softmax, and the classifier's output is the GLM's mean in process and in
the export (with a per-class probit, a shift per row is not harmless: the mean must be the
output the curvature is about).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from stress_nets import _train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit


class _Net(nn.Module):
    def __init__(self, ending: str = "log_softmax") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.fc = nn.Linear(16, 3)
        self.ending = ending

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(self.body(x))
        if self.ending == "log_softmax":
            return F.log_softmax(z, dim=1)
        if self.ending == "relu":  # not the same softmax
            return F.relu(z)
        return z


def _data(n: int = 120, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return DataLoader(TensorDataset(x, y), batch_size=40)


def _trained() -> _Net:
    net = _Net()  # cross-entropy of log-probabilities is nll_loss, as the MNIST example trains
    _train(net, *_data().dataset.tensors, steps=60, lr=1e-2, weight_decay=0.0)
    return net


@pytest.mark.parametrize("options", [{}, {"structure": "kron"}, {"structure": "diag"},
                                     {"link": "bridge"}])
def test_laplace_on_a_log_softmax_network_is_the_laplace_of_its_logits(options):
    net = _trained()
    plain = copy.deepcopy(net)
    plain.ending = "logits"
    x, _ = next(iter(_data(30, seed=2)))
    got = []
    for model in (net, plain):
        bnn = bayesify(copy.deepcopy(model), "laplace", prior_method="fixed", prior_precision=1.0,
                       **options)
        fit(bnn, _data(), progress=False)
        got.append(bnn.predictor(temperature=1.0)(x).probs)
    assert torch.allclose(got[0], got[1], atol=1e-6)
    with torch.no_grad():  # and a broad posterior: not the network's softmax
        assert (got[0] - net(x).exp()).abs().max() > 1e-3


@pytest.mark.parametrize("validate", [True, False])
def test_laplace_defaults_fit_and_export_a_log_softmax_network(validate, tmp_path):
    bnn = bayesify(_trained(), "laplace")
    fit(bnn, _data(), val_loader=_data(60, seed=1) if validate else None, progress=False)
    x, _ = next(iter(_data(30, seed=2)))
    predictor = bnn.predictor()
    info = predictor.export(tmp_path / "l.pt2", x[:3])
    assert info["max_abs_diff"] <= 1e-5
    probs, _ = torch.export.load(str(tmp_path / "l.pt2")).module()(x)
    assert torch.allclose(probs, predictor(x).probs, atol=1e-5)


def test_an_output_that_is_not_the_same_softmax_is_still_refused():
    net = _trained()
    net.ending = "relu"
    bnn = bayesify(net, "laplace", structure="kron")
    with pytest.raises(BayesifyError, match="produce the model's logits"):
        fit(bnn, _data(), progress=False)
