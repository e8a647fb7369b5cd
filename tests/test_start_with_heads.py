"""A trained state that is worse under the validation shift than the starting network with
its Laplace heads is not handed back (``BestState._start_with_heads``): the neutral knobs,
the paired decision, the exact restore when the trained state stays, and the rank-one
families' start as the network itself."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit
from bayesify.core.fitting import Knob
from bayesify.train import best as best_module
from bayesify.train.best import START_SHIFT_SE, BestState
from bayesify.train.tuning import neutral_knobs


@pytest.fixture(scope="module")
def pretrained():
    torch.manual_seed(0)
    x = torch.randn(240, 6)
    y = (x[:, 0] + 0.3 * x[:, 1] > 0).long()
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval(), DataLoader(TensorDataset(x, y), batch_size=60)


def test_neutral_knobs_make_every_member_the_network():
    """A spread multiplier at 0 (its ``one_sample_at``), a member temperature at its initial
    1, a knob with neither at its narrowest value; one value each, nothing else changed."""
    def knob(**kw):
        return Knob(name=kw.pop("name"), grid=kw.pop("grid"), meaning="m", set=lambda v: None,
                    **kw)

    spread = knob(name="s", grid=(0.0, 0.5, 1.0, 2.0), one_sample_at=0.0)
    member_t = knob(name="t", grid=(1.0, 1.5, 2.0), initial=1.0)
    scale = knob(name="c", grid=(0.1, 1.0, 10.0), initial=None)
    precision = knob(name="p", grid=(0.1, 1.0, 10.0), initial=None, prefer="smallest")
    out = neutral_knobs([spread, member_t, scale, precision])
    assert [k.grid for k in out] == [(0.0,), (1.0,), (0.1,), (10.0,)]
    assert [k.name for k in out] == ["s", "t", "c", "p"]
    assert out[0].one_sample_at == 0.0 and spread.grid == (0.0, 0.5, 1.0, 2.0)


def _best(net: nn.Module, start: dict[str, torch.Tensor]) -> BestState:
    best = BestState.__new__(BestState)
    best.state = SimpleNamespace(bnn=net, ctx=SimpleNamespace(is_main=True))
    best.active, best.start_state, best.initial, best.weighs_start = True, None, start, True
    return best


@pytest.mark.parametrize("offset, start_nll, kept", [
    (-0.5, 0.302, "start"),   # lower under shift by 10 paired SE, feasible: the start
    (-0.02, 0.302, "last"),   # lower by 0.4 SE only: the trained state stays
    (-0.5, 0.31, "last"),     # the start infeasible (> 0.3 + 0.005): the trained state stays
])
def test_the_start_with_heads_replaces_a_trained_state_only_when_clearly_better(
        offset, start_nll, kept):
    net = nn.Linear(2, 2)
    with torch.no_grad():
        net.weight.fill_(1.0)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        net.weight.fill_(2.0)  # the trained state
    best = _best(net, start)
    g = torch.Generator().manual_seed(0)
    family_shift = 2.0 + torch.randn(400, generator=g, dtype=torch.float64)
    scores: dict[str, torch.Tensor] = {"shift": family_shift}
    noise = torch.randn(400, generator=g, dtype=torch.float64)
    noise = (noise - noise.mean()) / noise.std()  # paired SE of the difference: 1/20

    def neutral():
        assert torch.all(net.weight == 1.0)  # searched on the start
        scores["shift"] = family_shift + offset + noise
        return {"knob": 0.0, "val_nll": start_nll, "val_shift_nll": float(scores["shift"].mean())}

    measured = []

    def measure():  # validated only when it is kept
        assert torch.all(net.weight == 1.0)
        measured.append(1)
        return {"val_nll": start_nll - 0.0005, "val_accuracy": 0.9}

    record = {"kept": "last", "kept_val_nll": 0.301, "kept_val_accuracy": 0.9, "knob": 1.0,
              "val_nll": 0.301, "val_shift_nll": float(family_shift.mean()),
              "start_tempered_val_nll": 0.3}
    best.retry_start(record, lambda: pytest.fail("the full retry ran"), neutral=neutral,
                     measure=measure, family_shift=family_shift, scores=scores)
    assert len(measured) == (kept == "start")
    d = (family_shift + offset + noise) - family_shift
    z = float(d.mean() / (d.std() / math.sqrt(len(d))))
    assert record["start_heads_shift_z"] == pytest.approx(z)
    assert (z < -START_SHIFT_SE) == (offset == -0.5)
    assert record["kept"] == kept and best.initial is None
    if kept == "start":
        assert torch.all(net.weight == 1.0) and record["knob"] == 0.0
        assert record["kept_val_nll"] == start_nll - 0.0005 and record["start_heads_val_nll"] == start_nll
        assert record["kept_val_shift_nll"] == pytest.approx(float(scores["shift"].mean()))
    else:
        assert torch.all(net.weight == 2.0) and record["knob"] == 1.0
        assert record["kept_val_nll"] == 0.301


def test_no_shift_scores_or_no_heads_search_nothing():
    net = nn.Linear(2, 2)
    best = _best(net, {k: v.clone() for k, v in net.state_dict().items()})
    record = {"kept": "last", "kept_val_nll": 0.301, "start_tempered_val_nll": 0.3,
              "val_shift_nll": 1.0}
    best.retry_start(record, lambda: pytest.fail("retry"),
                     neutral=lambda: pytest.fail("searched without shift scores"),
                     family_shift=None, scores={})
    assert record["kept"] == "last"
    best.initial = {k: v.clone() for k, v in net.state_dict().items()}
    best.retry_start(record, lambda: pytest.fail("retry"))  # a family without heads
    assert record["kept"] == "last"


def _predict(bnn, data):
    x = next(iter(data))[0]
    with torch.no_grad():
        return bnn.predictor().predict(x).log_probs


@pytest.mark.parametrize("method", ["ibnn", "rank1"])
def test_a_trained_state_that_stays_is_put_back_exactly(pretrained, monkeypatch, method):
    """The start's search runs and loses (threshold +inf): the model predicts exactly as the
    same fit without that search — weights, knobs, temperature and heads put back."""
    net, data = pretrained

    def run():
        torch.manual_seed(0)  # the initial posterior's draws
        bnn = bayesify(net, method, components=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            last = fit(bnn, data, val_loader=data, epochs=2, progress=False, seed=0).last
        return bnn, last

    monkeypatch.setattr(BestState, "_start_with_heads", lambda *a, **k: None)
    plain, plain_last = run()
    monkeypatch.undo()
    monkeypatch.setattr(best_module, "START_SHIFT_SE", math.inf)
    searched, last = run()
    assert plain_last["kept"] == last["kept"] == "last"
    assert "start_heads_shift_z" in last and "start_heads_shift_z" not in plain_last
    assert torch.equal(_predict(plain, data), _predict(searched, data))
    assert last["temperature"] == plain_last["temperature"]


@pytest.mark.parametrize("method, knob", [("ibnn", "ibnn_noise_scale"),
                                          ("rank1", "rank1_noise_scale"),
                                          ("batchensemble", "member_temperature")])
def test_an_adopted_start_is_the_network_with_heads(pretrained, monkeypatch, method, knob):
    """Threshold −inf (any feasible start wins): the fit hands back the start with its knob
    neutral, and every member is the base network bit for bit (rank1 and batchensemble
    through their ``network_state``: fast weights at 1)."""
    net, data = pretrained
    monkeypatch.setattr(best_module, "START_SHIFT_SE", -math.inf)
    bnn = bayesify(net, method, components=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        last = fit(bnn, data, val_loader=data, epochs=2, progress=False, seed=0).last
    assert last["kept"] == "start" and "start_heads_shift_z" in last
    assert bnn.state.value(knob) == (1.0 if knob == "member_temperature" else 0.0)
    x = next(iter(data))[0]
    with torch.no_grad():
        members = bnn.member_logits(x)
    assert torch.allclose(members, net(x).expand_as(members), atol=1e-5)


@pytest.mark.parametrize("method", ["ibnn", "meanfield"])
def test_one_sample_per_component_searches_the_start_as_all_samples_do(
        pretrained, monkeypatch, method):
    """At the neutral knob every sample of a component is the same network: the start's
    search with one sample per component (``one_sample_per_component``) chooses and
    predicts as the search with the default samples, at 1/S of the member forwards."""
    import contextlib

    from bayesify.train import loop

    net, data = pretrained
    monkeypatch.setattr(best_module, "START_SHIFT_SE", -math.inf)

    def run():
        torch.manual_seed(0)
        bnn = bayesify(net, method, **({"components": 2} if method == "ibnn" else {}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            last = fit(bnn, data, val_loader=data, epochs=2, progress=False, seed=0).last
        return bnn, last

    one, one_last = run()
    assert one.posterior_config.default_samples() > 1  # put back after the search
    monkeypatch.setattr(loop, "one_sample_per_component", lambda *a: contextlib.nullcontext())
    every, every_last = run()
    assert one_last["kept"] == every_last["kept"] == "start"
    for key in ("temperature", "heads_prior_precision", "kept_val_nll", "start_heads_shift_z"):
        assert one_last[key] == pytest.approx(every_last[key], rel=1e-4, abs=1e-7), key
    assert torch.allclose(_predict(one, data), _predict(every, data), atol=1e-5)


def test_the_hand_back_message_never_prints_one_number_as_two():
    """The warning says the start was lower under the shift; with four decimals a small gap
    read "NLL 0.0311 … (0.0311, 1.8 paired standard errors lower)". ``apart`` adds decimals
    until the two differ, and keeps four where they already do."""
    assert best_module.apart(0.031108, 0.031062) == ("0.03111", "0.03106")
    assert best_module.apart(1.5, 0.25) == ("1.5000", "0.2500")
    assert best_module.apart(0.2, 0.2) == ("0.20000000", "0.20000000")  # equal: as far as it goes
