"""Layers whose input does not carry the batch: a table every example shares (Swin V2's
continuous position bias MLP on its coordinate table — Hugging Face's
``continuous_position_bias_mlp``, timm's and torchvision's ``cpb_mlp``).

Before the thirty-sixth stop every family that draws per row or per member (iBNN, rank-1,
BatchEnsemble, the ensemble, MC dropout, mean-field, MNF, the hypernetwork) stopped at the
first forward ("a wrapped layer received 1 rows but the sampling plan has 64"). Such a layer
now runs as the network's own layer (its output is added to every example, so it cannot
differ per member), logged once; every other layer keeps its posterior.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit, list_methods


class TableBiased(nn.Module):
    """``head(mean_tokens(norm(relu(body(x) + mlp(table)))))``: ``mlp`` sees a ``[1, 5, 2]``
    coordinate table, not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(-1, 1, 10).view(1, 5, 2))
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.mlp(self.table)  # [1, 5, 4]: every example's
        return self.head(self.norm(torch.relu(self.body(x) + bias)).mean(1))


def data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, 4, generator=g)
    return TensorDataset(x, (x[:, 0, 0] > 0).long() + (x[:, 1, 1] > 0).long())


def model() -> nn.Module:
    torch.manual_seed(0)
    return TableBiased().eval()


@pytest.mark.parametrize("family", list_methods())
def test_every_family_fits_and_predicts_a_network_with_a_shared_table(family, caplog):
    bnn = bayesify(model(), family)
    with caplog.at_level(logging.INFO, logger="bayesify.core.layout"):
        fit(bnn, DataLoader(data(), batch_size=16), epochs=1, progress=False, seed=0)
        probs = bnn.predictor()(data(8, 1).tensors[0]).probs
    assert probs.shape == (8, 3) and torch.isfinite(probs).all()
    layers = bnn.bayesian_layers()
    table = [layer for name, layer in layers.items() if name.startswith("mlp.")
             and layer.deals_rows]
    assert all(layer.layout is None and layer.batch_free for layer in table)
    assert all(layer.layout == 0 for name, layer in layers.items()
               if not name.startswith("mlp.") and layer.deals_rows)
    if table:  # said once, by the probe
        told = [r.getMessage() for r in caplog.records if "without the batch" in r.getMessage()]
        assert len(told) == 1 and f"; {len(table)} take an input without" in told[0]


def test_a_traced_first_forward_takes_one_row_under_a_plan_of_several_as_a_table(caplog):
    """Where no probe ran (a first forward under torch.compile / export), the rule of one
    row under a plan of several rows stands in, logged once per layer."""
    bnn = bayesify(model(), "ibnn")
    bnn.context.layout_probed = True  # as if traced: no probe
    x = data(4, 2).tensors[0]
    with caplog.at_level(logging.INFO, logger="bayesify.core.layers"), torch.no_grad():
        bnn.predictor()(x)
        bnn.predictor()(x)
    told = [r.getMessage() for r in caplog.records if "does not carry the batch" in r.getMessage()]
    assert len(told) == 2  # mlp.0 and mlp.2, once each
    assert bnn.bayesian_layers()["mlp.0"].batch_free


@pytest.mark.parametrize("family", ["ibnn", "rank1", "ensemble"])
def test_the_shared_table_is_the_networks_and_the_members_still_differ(family):
    """Inside a prediction of several members the table MLP's output is the network's own,
    while the layers that see the batch differ between members."""
    bnn = bayesify(model(), family)
    fit(bnn, DataLoader(data(), batch_size=16), epochs=1, progress=False, seed=0)
    net = bnn.unwrap()
    with torch.no_grad():
        expected = net.mlp(net.table)
    seen: dict[str, torch.Tensor] = {}
    layers = bnn.bayesian_layers()
    layers["mlp.2"].base_layer.register_forward_hook(
        lambda m, a, out: seen.__setitem__("mlp", out))
    layers["body"].register_forward_hook(lambda m, a, out: seen.__setitem__("body", out))
    with torch.no_grad():
        bnn.predictor()(data(1, 2).tensors[0])
    torch.testing.assert_close(seen["mlp"], expected)
    body = seen["body"]  # [members, 5, 4]: one row per member for the one example
    assert body.shape[0] > 1 and (body - body[:1]).abs().amax() > 1e-4


@pytest.mark.parametrize("family", ["ensemble", "hypernet", "rank1"])
def test_the_export_of_a_network_with_a_shared_table_equals_it_in_process(family, tmp_path):
    """The member copies of an export (the ensemble's components, the hypernetwork's
    generated networks) keep the table layer's network weights, as the members do in
    process; before, the copies carried member weights there (0.002 apart)."""
    from export_check import assert_export_matches

    bnn = bayesify(model(), family)
    fit(bnn, DataLoader(data(), batch_size=16), epochs=1, progress=False, seed=0)
    assert_export_matches(bnn.predictor(), tmp_path / "p.pt2", data(8, 1).tensors[0])
