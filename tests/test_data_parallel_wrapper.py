"""A network handed over inside ``nn.DataParallel`` (a checkpoint loaded as it was trained):
bayesify uses its ``.module``. Before, SWAG failed mid-fit ("The stateless API can't be used
with nn.DataParallel module"); now every family's posterior is the one of the inner network,
exactly, and a saved posterior loads around the wrapped network too."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit, load_posterior


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3)).eval()


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()),
                      batch_size=32)


def _fitted(model: nn.Module, method: str):
    torch.manual_seed(1)
    bnn = bayesify(model, method)
    fit(bnn, _loader(), val_loader=_loader(), epochs=1, progress=False, seed=0)
    return bnn


@pytest.mark.parametrize("method", ["swag", "ibnn", "laplace"])
def test_a_data_parallel_network_gets_its_inner_networks_posterior(method, tmp_path):
    wrapped = nn.DataParallel(_net())
    bnn = _fitted(wrapped, method)
    plain = _fitted(_net(), method)
    assert isinstance(wrapped, nn.DataParallel)  # the caller's wrapper is left as it was
    assert not any(isinstance(m, nn.DataParallel) for m in bnn.modules())
    x = _loader().dataset.tensors[0][:8]
    ours = bnn.predictor(seed=0)(x).probs
    torch.testing.assert_close(ours, plain.predictor(seed=0)(x).probs, rtol=0, atol=0)
    bnn.save_posterior(tmp_path / "post")
    loaded = load_posterior(nn.DataParallel(_net()), tmp_path / "post")
    torch.testing.assert_close(loaded.predictor(seed=0)(x).probs, ours, rtol=0, atol=1e-6)


def test_a_compiled_network_gets_its_inner_networks_posterior_and_loads_onto_it(tmp_path):
    """``torch.compile(net)`` (an ``OptimizedModule``, names prefixed ``_orig_mod.``): before
    the thirty-fifth stop bayesify wrapped the compiled module — a 3-layer MLP's one-epoch fit
    took 16 s of recompiles, and the saved posterior refused to load onto the network it
    compiled ("the base model … is not the one this posterior was fitted on"). Now the
    network inside is used: the same posterior as the plain network's, loadable both ways."""
    compiled = torch.compile(_net())
    bnn = _fitted(compiled, "ibnn")
    plain = _fitted(_net(), "ibnn")
    assert type(compiled).__name__ == "OptimizedModule"  # the caller's wrapper is left alone
    assert not any(type(m).__name__ == "OptimizedModule" for m in bnn.modules())
    assert not any("_orig_mod" in name for name in bnn.bayesian_layers())
    x = _loader().dataset.tensors[0][:8]
    ours = bnn.predictor(seed=0)(x).probs
    torch.testing.assert_close(ours, plain.predictor(seed=0)(x).probs, rtol=0, atol=0)
    bnn.save_posterior(tmp_path / "post")
    loaded = load_posterior(_net(), tmp_path / "post")
    torch.testing.assert_close(loaded.predictor(seed=0)(x).probs, ours, rtol=0, atol=1e-6)
    again = load_posterior(torch.compile(_net()), tmp_path / "post")
    torch.testing.assert_close(again.predictor(seed=0)(x).probs, ours, rtol=0, atol=1e-6)
