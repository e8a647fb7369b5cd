"""Without validation data the training examples keep a fit from ending clearly worse than
the network it started from (bayesify.train.start_guard)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit
from bayesify.train import start_guard
from tests.pretrained_nets import fit_full_batch


def _task(n: int = 200) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, :3] + 0.3 * torch.randn(n, 3, generator=g)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=20, shuffle=True,
                      generator=torch.Generator().manual_seed(1))


def _pretrained(loader: DataLoader) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    return fit_full_batch(net, net.parameters(), *loader.dataset.tensors, lr=1e-2)


def _accuracy(bnn, loader: DataLoader) -> float:
    x, y = loader.dataset.tensors
    with torch.no_grad():
        return float((bnn.predictor(temperature=1.0)(x).probs.argmax(-1) == y).float().mean())


def test_dropped_is_a_point_and_more_than_a_few_examples():
    assert not start_guard.dropped(0.99, 0.985, 1000)  # half a point
    assert start_guard.dropped(0.99, 0.95, 1000)  # 40 examples, 2σ = 6.3
    assert not start_guard.dropped(0.9, 0.85, 40)  # 2 examples: within 2σ (3.8)
    n, a = 300, 0.9
    noise = 2 * math.sqrt(n * a * (1 - a)) / n  # 0.0346
    assert not start_guard.dropped(a, a - noise + 1e-3, n)
    assert start_guard.dropped(a, a - noise - 1e-3, n)


def test_a_fit_that_loses_the_training_accuracy_hands_back_its_start(caplog):
    loader = _task()
    net = _pretrained(loader)
    x, y = loader.dataset.tensors
    with torch.no_grad():
        start_acc = float((net(x).argmax(-1) == y).float().mean())
        reference = {k: v.clone() for k, v in net.state_dict().items()}
    # a learning rate 500× the family's: the means are thrown off the network
    bnn = bayesify(net, "meanfield", per_network=False)
    with caplog.at_level("WARNING", logger="bayesify.train.start_guard"):
        record = fit(bnn, loader, epochs=2, lr=0.5, progress=False).history[-1]
    assert record["kept"] == "start"
    assert record["end_train_accuracy"] < record["start_train_accuracy"] - 0.05
    assert record["start_train_accuracy"] == pytest.approx(start_acc)
    assert "keeps the state it began with" in caplog.text
    for name, layer in bnn.bayesian_layers().items():  # the means are the network again
        torch.testing.assert_close(layer.weight_mu, reference[f"{name}.weight"])
    assert _accuracy(bnn, loader) >= start_acc - 0.02


def test_a_fit_that_keeps_the_training_accuracy_is_handed_back_as_it_ended():
    loader = _task()
    bnn = bayesify(_pretrained(loader), "meanfield")
    record = fit(bnn, loader, epochs=2, progress=False).history[-1]
    assert "kept" not in record
    assert not start_guard.dropped(record["start_train_accuracy"],
                                   record["end_train_accuracy"], 200)
    assert any(not torch.equal(layer.weight_mu, layer.base_layer.weight)
               for layer in bnn.bayesian_layers().values())  # trained, not reset


def test_with_validation_the_guard_stays_out():
    loader = _task()
    bnn = bayesify(_pretrained(loader), "meanfield")
    record = fit(bnn, loader, val_loader=_task(60), epochs=1, progress=False).history[-1]
    assert "start_train_accuracy" not in record
