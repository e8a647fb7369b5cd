"""Laplace on layers under ``torch.nn.utils.parametrize`` (weight norm, spectral norm).

Found by running every family's defaults on a weight-normed MLP (benchmarks/held_out_nets.py
``weight_norm_mlp``, thirty-third stop): ``laplace`` counted the classifier's parameters as
its originals ``g`` and ``v`` (660) while the last-layer curvature is over the weight the
layer computes and its bias (650), and ``fit`` failed with "The size of tensor a (660) must
match the size of tensor b (650)". The posterior is now over the computed weight
(:meth:`LaplaceLayer.posterior_parameters`).
A subnetwork posterior over parametrized layers (``targets='all'``) is refused at ``bayesify``:
its per-example Jacobians go through ``functional_call``, which writes a value given for a
parametrized weight back into its originals.
"""

from __future__ import annotations

import copy

import pytest
import torch
from stress_nets import _train
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit
from bayesify.methods.laplace import state
from bayesify.methods.laplace.layers import LaplaceLayer


def _net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    wrap = parametrizations.weight_norm if kind == "weight" else parametrizations.spectral_norm
    model = nn.Sequential(wrap(nn.Linear(4, 16)), nn.ReLU(), wrap(nn.Linear(16, 3)))
    _train(model, *_data().dataset.tensors, steps=60, lr=1e-2, weight_decay=0.0)
    return model


def _data(n: int = 96, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return DataLoader(TensorDataset(x, y), batch_size=32)


@pytest.mark.parametrize("kind", ["weight", "spectral"])
@pytest.mark.parametrize("options", [{}, {"structure": "kron"}, {"structure": "diag"}])
def test_laplace_fits_parametrized_layers_and_a_huge_prior_is_the_network(kind, options):
    model = _net(kind)
    bnn = bayesify(copy.deepcopy(model), "laplace", prior_method="fixed", prior_precision=1e12,
                   **options)
    fit(bnn, _data(), progress=False)
    for layer in state.layers(bnn).values():  # the computed weight [C, D] and the bias
        assert layer.num_params() == layer.base_layer.weight.numel() + layer.base_layer.bias.numel()
    x, _ = next(iter(_data(32, seed=2)))
    with torch.no_grad():
        expected = model(x).softmax(-1)
    assert torch.allclose(bnn.predictor(temperature=1.0)(x).probs, expected, atol=1e-5)
    bnn.method.set_prior_precision(bnn, 1e-2)  # broad: the posterior is not the network
    assert (bnn.predictor(temperature=1.0)(x).probs - expected).abs().max() > 1e-3


def test_a_subnetwork_posterior_over_parametrized_layers_is_refused_before_anything_changes():
    model = _net("weight")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BayesifyError, match="parametrize"):
        bayesify(model, "laplace", targets="all", structure="diag")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, LaplaceLayer) for m in model.modules())


@pytest.mark.parametrize("kind", ["weight", "spectral"])
def test_laplace_defaults_on_parametrized_layers_with_validation(kind):
    bnn = bayesify(_net(kind), "laplace")
    fit(bnn, _data(), val_loader=_data(60, seed=1), progress=False)
    x, _ = next(iter(_data(32, seed=2)))
    assert torch.isfinite(bnn.predictor()(x).probs).all()


def test_a_weight_normed_laplace_exports_as_it_predicts(tmp_path):
    bnn = bayesify(_net("weight"), "laplace")
    fit(bnn, _data(), val_loader=_data(60, seed=1), progress=False)
    x, _ = next(iter(_data(32, seed=2)))
    info = bnn.predictor().export(tmp_path / "w.pt2", x[:3])
    assert info["max_abs_diff"] <= 1e-5
    probs, _ = torch.export.load(str(tmp_path / "w.pt2")).module()(x)
    assert torch.allclose(probs, bnn.predictor()(x).probs, atol=1e-5)
