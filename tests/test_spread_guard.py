"""Without validation data a gradient fit keeps the largest spread multiplier (1, ½, ¼, 0.1,
else 0) whose predictive keeps the mean network's training accuracy within a point
(bayesify.train.spread_guard)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayesify
from bayesify.train.spread_guard import GUARD_SCALES, spread_knobs


def task(n: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + 2 * (x[:, 3] > 0).long()
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g)


def accuracy(bnn, loader) -> float:
    right = total = 0
    for x, y in loader:
        right += int((bnn.predictive(x, seed=0).probs.argmax(-1) == y).sum())
        total += len(y)
    return right / total


def test_a_spread_that_costs_training_accuracy_is_narrowed(caplog):
    net, train = task()
    # an initial spread of 300 % of every weight, barely trained: far too broad
    bnn = bayesify.bayesify(net, "meanfield", delta=3.0)
    with caplog.at_level(logging.INFO, logger="bayesify.train.spread_guard"):
        result = bayesify.fit(bnn, train, epochs=1, lr=1e-6, progress=False, seed=0)
    knob = spread_knobs(bnn.method.knobs(bnn))[0]
    chosen = bnn.state.value(knob.name)
    record = result.last
    assert chosen < 1.0 and record[knob.name] == chosen
    assert chosen in (*GUARD_SCALES, 0.0)
    # what it promises: the chosen predictive within a point of the mean network's accuracy
    assert record["guard_train_accuracy_spread"] < record["guard_train_accuracy_mean"] - 0.01
    bnn.state.set(knob.name, chosen)
    kept = accuracy(bnn, train)
    bnn.state.set(knob.name, 0.0)
    assert kept >= accuracy(bnn, train) - 0.01 - 1e-9
    bnn.state.set(knob.name, 1.0)
    assert accuracy(bnn, train) < kept - 0.01  # the untouched spread would have cost more
    assert any("no val_loader to choose the spread on" in r.getMessage() for r in caplog.records)


def test_a_harmless_spread_is_kept_and_validation_bypasses_the_guard():
    net, train = task()
    bnn = bayesify.bayesify(net, "meanfield", delta=1e-3)  # a point mass, nearly
    result = bayesify.fit(bnn, train, epochs=1, progress=False, seed=0)
    knob = spread_knobs(bnn.method.knobs(bnn))[0]
    assert bnn.state.value(knob.name) == 1.0 and result.last[knob.name] == 1.0
    wide = bayesify.bayesify(task()[0], "meanfield", delta=3.0)
    result = bayesify.fit(wide, train, val_loader=train, epochs=1, lr=1e-6, progress=False,
                          seed=0)
    assert "guard_train_accuracy_mean" not in result.last  # the search chose it instead


def test_member_temperatures_are_not_spread_knobs():
    net, _ = task()
    assert spread_knobs(bayesify.bayesify(net, "ensemble").method.knobs(
        bayesify.bayesify(net, "ensemble"))) == []


def test_a_resumed_fit_guards_the_spread_as_an_uninterrupted_one(tmp_path):
    from test_resume import Kill, KillAt

    net, train = task()
    opts = {"epochs": 2, "lr": 1e-6, "seed": 3, "progress": False}
    full = bayesify.bayesify(net, "meanfield", delta=3.0)
    bayesify.fit(full, train, **opts)
    knob = spread_knobs(full.method.knobs(full))[0].name
    assert full.state.value(knob) < 1.0
    first = bayesify.bayesify(net, "meanfield", delta=3.0)
    try:
        bayesify.fit(first, train, checkpoint_dir=tmp_path, callbacks=[KillAt(epoch=1)], **opts)
    except Kill:
        pass
    resumed = bayesify.bayesify(net, "meanfield", delta=3.0)
    bayesify.fit(resumed, train, checkpoint_dir=tmp_path, resume=tmp_path, **opts)
    assert resumed.state.value(knob) == full.state.value(knob)
