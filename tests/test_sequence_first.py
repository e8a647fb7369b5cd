"""Networks whose layers take the batch in the second dimension (``[length, batch, …]``):
``nn.TransformerEncoder`` with its default ``batch_first=False``, Hugging Face's XLNet.

Before the thirty-sixth stop every family that deals rows to members stopped at their first
wrapped layer ("a wrapped layer received 10 rows but the sampling plan has 32") or, where the
length was a multiple of the plan's rows, dealt sequence positions to members silently. The
layout probe (:mod:`bayesify.core.layout`) finds each layer's batch dimension from two small
passes; a sequence-first layer is fed transposed. The check: the same network written batch
first, fitted and predicted alike, gives the same posterior and predictions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit
from bayesify.core.layout import batch_dimension


class Encoder(nn.Module):
    """Linear embedding, a two-layer Transformer encoder, mean over the sequence, a head."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Linear(4, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, L, 4]
        h = self.emb(x)
        if self.batch_first:
            return self.head(self.enc(h).mean(1))
        return self.head(self.enc(h.transpose(0, 1)).mean(0))


def twins() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    seq_first = Encoder(batch_first=False).eval()
    batch_first = Encoder(batch_first=True).eval()
    batch_first.load_state_dict(seq_first.state_dict())
    return seq_first, batch_first


def data(n: int, length: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, 4, generator=g)
    return TensorDataset(x, (x[:, 0, 0] > 0).long() + (x[:, 1, 1] > 0).long())


def test_the_twins_are_one_network():
    seq_first, batch_first = twins()
    x = data(5, 7).tensors[0]
    torch.testing.assert_close(seq_first(x), batch_first(x))


@pytest.mark.parametrize("family", ["ibnn", "rank1", "batchensemble", "ensemble", "dropout",
                                    "abnn", "meanfield"])
@pytest.mark.parametrize("length", [7, 32])  # 32: the prediction plan's rows (8 × 4 members)
def test_a_sequence_first_network_is_bayesified_as_its_batch_first_twin(family, length):
    seq_first, batch_first = twins()
    got = []
    for net in (seq_first, batch_first):
        torch.manual_seed(0)  # the posterior's initial draws alike
        bnn = bayesify(net, family)
        fit(bnn, DataLoader(data(48, length), batch_size=16), epochs=1, progress=False, seed=0)
        x = data(8, length, seed=1).tensors[0]
        got.append(bnn.predictor(samples_per_component=4 // bnn.method.components or 1)(x))
    torch.testing.assert_close(got[0].probs, got[1].probs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[0].epistemic, got[1].epistemic, rtol=1e-3, atol=1e-5)
    assert float(got[0].epistemic.max()) > 1e-6  # members that differ, not the network four times


def test_the_probe_leaves_modes_and_statistics_as_they_were():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    bnn = bayesify(net, "ibnn")
    bn = bnn.model[1]
    before = bn.running_mean.clone(), int(bn.num_batches_tracked)
    bnn.bn_train = True
    bnn.train()
    with bnn.context.use(torch.zeros(6, dtype=torch.long)):
        bnn(torch.randn(6, 4))  # the first planned forward: the probe runs first
    assert bnn.context.layout_probed
    assert all(m.training for m in bnn.modules())
    assert int(bn.num_batches_tracked) == before[1] + 1  # the forward's, not the probe's
    assert [layer.layout for layer in bnn.bayesian_layers().values()] == [0, 0]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in bnn.model.modules())


def test_batch_dimension_reads_the_dimension_that_grows():
    s = torch.Size
    assert batch_dimension([s([2, 5])], [s([3, 5])]) == 0
    assert batch_dimension([s([7, 2, 16])], [s([7, 3, 16])]) == 1
    assert batch_dimension([s([8, 4, 16])], [s([12, 4, 16])]) == 0  # 4 windows per example
    assert batch_dimension([s([1, 5, 2])], [s([1, 5, 2])]) is None  # a shared table
    assert batch_dimension([s([2, 5]), s([1, 5])], [s([3, 5]), s([1, 5])]) == "unknown"
    assert batch_dimension([], []) == "unknown"
    assert batch_dimension([s([5, 6, 2])], [s([5, 6, 3])]) == "unknown"  # not in front


@pytest.mark.parametrize("family", ["ibnn", "ensemble"])
def test_the_export_of_a_sequence_first_network_equals_it_in_process(family, tmp_path):
    from export_check import assert_export_matches

    seq_first, _ = twins()
    torch.manual_seed(0)
    bnn = bayesify(seq_first, family)
    fit(bnn, DataLoader(data(48, 7), batch_size=16), epochs=1, progress=False, seed=0)
    assert_export_matches(bnn.predictor(), tmp_path / "p.pt2", data(8, 7, seed=1).tensors[0])
