"""A fit never hands back something clearly worse on validation than what it started from
(issue 37, item 7; DESIGN.md §11): the best validated state, the start included, is kept
and said; the CLI exits non-zero and ``bayesify calibrate`` refuses when even that is worse."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit
from bayesify.train import best as best_module
from bayesify.train.best import clearly_worse


@pytest.fixture(scope="module")
def pretrained():
    torch.manual_seed(0)
    x = torch.randn(200, 4)
    y = (x[:, 0] > 0).long()
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(200):  # near-perfect on this split
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval(), DataLoader(TensorDataset(x, y), batch_size=50)


def test_a_destructive_fit_hands_back_the_start(pretrained, caplog):
    net, data = pretrained
    # the family alone: its default Laplace heads, searched on the destroyed members, take
    # back part of the NLL, and the start is then kept by the search's retry instead
    bnn = bayesify(net, "ibnn", init_mean_std=0.0, laplace_heads=False)
    initial = {k: v.clone() for k, v in bnn.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with caplog.at_level("INFO", logger="bayesify.train"):
            result = fit(bnn, data, val_loader=data, lr=5.0, epochs=3, progress=False, seed=0)
    last = result.last
    # the lr destroyed the network: the last validation is far worse than the start ...
    assert clearly_worse({"accuracy": last["start_val_accuracy"] if "start_val_accuracy" in last
                          else result[0]["start_val_accuracy"],
                          "nll": result[0]["start_val_nll"]}, last)
    # ... so the fit kept the posterior it began with, bit for bit, and said so
    assert last["kept"] == "start" and last["worse_than_start"] is False
    after = bnn.state_dict()
    for key, value in initial.items():
        if not key.startswith("state."):  # the search's knob and T: searched again, below
            assert torch.equal(after[key], value), key
    # the knob and T the search chose for the *last* state do not ride along: the search ran
    # again on the kept one, and the model predicts with what the record says
    assert float(after["state.ibnn_noise_scale"]) == last["ibnn_noise_scale"]
    assert bnn.state.temperature == pytest.approx(last["temperature"])
    assert "kept_val_shift_nll" in last and last["val_nll"] > last["kept_val_nll"]
    assert "keeps the state of start" in caplog.text
    # the log says what the kept state is once its own knobs are searched (the warning's
    # NLL is at the last state's, which once read 2.1996 for a start that ended at 0.134)
    assert (f"searched again: validation accuracy {last['kept_val_accuracy']:.4f}, "
            f"NLL {last['kept_val_nll']:.4f}") in caplog.text
    metrics = bnn.predictor().evaluate(data, progress=False)
    assert metrics["nll"] == pytest.approx(last["kept_val_nll"], rel=1e-5)
    assert metrics["accuracy"] >= result[0]["start_val_accuracy"] - 0.01


def test_the_start_ibnn_falls_back_to_is_the_network_itself(pretrained):
    """iBNN's initial node means are spread around 1 (``init_mean_std``), so the state a fit
    began with is not the network: keep-best's start is the posterior with every mean at 1,
    which at noise scale 0 is the base network bit for bit (a 64-image network's iBNN start
    had been 0.07 nats above it on validation, and −2.3 accuracy points held out)."""
    net, data = pretrained
    bnn = bayesify(net, "ibnn", init_mean_std=0.3)
    initial = {k: v.clone() for k, v in bnn.state_dict().items()}
    assert any(not torch.equal(v, torch.ones_like(v)) for k, v in initial.items()
               if k.endswith(".mean"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        last = fit(bnn, data, val_loader=data, lr=5.0, epochs=3, progress=False, seed=0).last
    assert last["kept"] == "start"
    after = bnn.state_dict()
    for key, value in initial.items():
        if key.endswith(".mean"):
            assert torch.equal(after[key], torch.ones_like(value)), key
        elif not key.startswith("state."):
            assert torch.equal(after[key], value), key
    bnn.state.set("ibnn_noise_scale", 0.0)
    x = next(iter(data))[0]
    with torch.no_grad():
        members = bnn.member_logits(x, samples_per_component=2)
    assert torch.allclose(members, net(x).expand_as(members), atol=1e-6)


def test_a_fit_the_search_cannot_make_feasible_hands_back_the_start():
    """Within 10 % of the start's NLL (not "clearly worse") but more than the search's
    0.005 nats above the start at its best temperature: no (knob, T) was feasible, so the
    start is a candidate too, and it is kept."""
    from bayesify.train.best import infeasible

    torch.manual_seed(0)
    x = torch.randn(200, 4)
    y = (x[:, 0] + 0.5 * torch.randn(200) > 0).long()  # noisy labels: start NLL ≈ 0.26
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(60):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    data = DataLoader(TensorDataset(x, y), batch_size=50)
    # the family alone (its default Laplace heads make this fit feasible)
    bnn = bayesify(net.eval(), "ibnn", init_mean_std=0.0, laplace_heads=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fit(bnn, data, val_loader=data, lr=0.6, epochs=3, progress=False, seed=0)
    last, start = result.last, {"accuracy": result[0]["start_val_accuracy"],
                                "nll": result[0]["start_val_nll"]}
    assert not clearly_worse(start, last) and infeasible(last)
    assert last["kept"] == "start"
    assert last["kept_val_nll"] <= last["start_tempered_val_nll"] + 0.005
    assert infeasible({"val_nll": 0.298, "start_tempered_val_nll": 0.294}) == []
    assert infeasible({"val_nll": 0.300}) == []


def test_a_good_fit_keeps_its_last_state(pretrained):
    net, data = pretrained
    # the never-worse rule alone (with Laplace heads the start with them is weighed too:
    # tests/test_start_with_heads.py)
    bnn = bayesify(net, "ibnn", init_mean_std=0.0, laplace_heads=False)
    result = fit(bnn, data, val_loader=data, lr=0.01, epochs=2, progress=False, seed=0)
    assert result.last["kept"] == "last" and result.last["worse_than_start"] is False


FAST = ["--no-progress", "--option", "components=2", "--option", "predict_samples=1"]


def test_exit_code_and_calibrate_refusal_follow_the_fits_outcome(tmp_path, capsys):
    from bayesify.cli import exit_if_worse, fit_outcome, refuse_worse_run
    from bayesify.errors import BayesifyError

    history = [{"epoch": 1, "start_val_accuracy": 1.0, "start_val_nll": 0.03},
               {"epoch": 2, "val_accuracy": 0.33, "val_nll": 1.1, "kept": "start",
                "kept_val_accuracy": 0.5, "kept_val_nll": 0.9, "worse_than_start": True}]
    assert exit_if_worse(history, tmp_path, "ibnn") == 3
    err = capsys.readouterr().err
    assert "accuracy 0.5000 vs 1.0000" in err and "`bayesify methods ibnn`" in err
    (tmp_path / "run.json").write_text(json.dumps({"outcome": fit_outcome(history)}))
    with pytest.raises(BayesifyError, match="calibrating it would hide that"):
        refuse_worse_run(str(tmp_path))
    history[-1]["worse_than_start"] = False
    assert exit_if_worse(history, tmp_path, "ibnn") == 0
    (tmp_path / "run.json").write_text(json.dumps({"outcome": fit_outcome(history)}))
    refuse_worse_run(str(tmp_path))  # a run no worse than its start is calibrated


def test_cli_exits_nonzero_and_calibrate_refuses_a_run_worse_than_its_start(tmp_path, capsys):
    """`bayesify fit` of a snapshot ensemble at a learning rate that wrecks every snapshot:
    its step builds the posterior from the trajectory and has no start to hand back, so the
    run ends clearly worse than its network — exit 3 with the comparison; `bayesify
    calibrate` on that run refuses. (Families that can restore their start hand it back
    instead: keep-best, above.)"""
    from bayesify.cli import main

    out = tmp_path / "run"
    code = main(["fit", "--map-epochs", "3", "--epochs", "2", "--out", str(out), "--no-progress",
                 "--method", "ensemble", "--option", "components=2", "--option",
                 "snapshot=true", "--lr", "50"])
    run = json.loads((out / "run.json").read_text())
    assert run["outcome"]["worse_than_start"] is True and code == 3
    assert run["outcome"]["kept"] == "last"
    assert "worse on validation than the network it started from" in capsys.readouterr().err
    assert main(["calibrate", "--posterior", str(out), "--no-progress"]) == 2
    assert "calibrating it would hide that" in capsys.readouterr().err
    assert not (out / "calibration.json").exists()


def test_clearly_worse_needs_more_than_a_flipped_example_with_a_better_nll():
    start = {"accuracy": 1 / 3, "nll": 1.1395}
    assert clearly_worse(start, {"val_accuracy": 0.0, "val_nll": 1.1054}) == []
    assert clearly_worse(start, {"val_accuracy": 0.0, "val_nll": 1.2}) == [
        "accuracy 0.0000 < 0.3333"]
    assert clearly_worse({"accuracy": 1.0, "nll": 0.026},
                         {"val_accuracy": 0.333, "val_nll": 1.097}) == [
        "accuracy 0.3330 < 1.0000", "NLL 1.0970 > 0.0260"]
    assert clearly_worse(start, {"val_accuracy": 0.34, "val_nll": float("nan")})


@pytest.mark.parametrize("start_nll, kept", [(0.31, "start"), (0.6, "last")])
def test_a_kept_state_still_infeasible_is_weighed_against_the_searched_start(start_nll, kept):
    """BestState.retry_start: the kept state's searched NLL (0.5) is above the calibrated
    start (0.3) + 0.005, so the start is loaded, searched and kept when its searched NLL is
    lower; otherwise the kept state (weights and searched knobs) is put back."""
    from types import SimpleNamespace

    from bayesify.train.best import BestState

    net = nn.Linear(2, 2)
    with torch.no_grad():
        net.weight.fill_(1.0)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        net.weight.fill_(2.0)  # the trained, kept state
    best = BestState.__new__(BestState)
    best.state = SimpleNamespace(bnn=net, ctx=SimpleNamespace(is_main=True))
    best.active, best.start_state, best.initial = True, None, start

    def retune():  # "searched" NLL: 0.5 for the kept weights, start_nll for the start's
        at_start = bool(torch.all(net.weight == 1.0))
        nll = start_nll if at_start else 0.5
        return {"knob": 0.0 if at_start else 1.0, "val_nll": nll}, {"val_nll": nll,
                                                                    "val_accuracy": 0.9}

    record = {"kept": "last", "kept_val_nll": 0.5, "kept_val_accuracy": 0.9, "knob": 1.0,
              "start_tempered_val_nll": 0.3}
    best.retry_start(record, retune)
    assert record["kept"] == kept and best.initial is None
    if kept == "start":
        assert torch.all(net.weight == 1.0) and record["kept_val_nll"] == start_nll
        assert record["knob"] == 0.0
    else:
        assert torch.all(net.weight == 2.0) and record["kept_val_nll"] == 0.5
        assert record["knob"] == 1.0
    # a feasible kept state is left alone
    record = {"kept": "last", "kept_val_nll": 0.302, "start_tempered_val_nll": 0.3}
    best.initial = start
    best.retry_start(record, lambda: pytest.fail("searched a feasible state's start"))
    assert record["kept"] == "last"
    # ... unless only its Laplace heads made it feasible: the start is searched with heads too
    record = {"kept": "last", "kept_val_nll": 0.302, "kept_val_accuracy": 0.9, "knob": 1.0,
              "start_tempered_val_nll": 0.3, "family_val_nll": 0.32}
    best.initial = start
    start_nll = 0.29  # the start with its heads
    best.retry_start(record, retune)
    assert record["kept"] == "start" and record["kept_val_nll"] == 0.29


@pytest.mark.parametrize("start_nll, start_shift, kept", [
    (0.303, 1.4, "start"),  # both feasible: the lower shifted NLL, whatever the clean one
    (0.290, 2.0, "last"),
    (0.310, 1.0, "last"),  # the start infeasible (> 0.3 + 0.005), the kept state feasible
])
def test_a_state_rescued_by_its_heads_and_the_start_are_weighed_by_the_search_rule(
        start_nll, start_shift, kept):
    """BestState.retry_start after member-wise Laplace heads rescued the trained state: both
    searched states feasible → the lower shifted validation NLL (the knob search's rule), not
    the lower clean one; a feasible state beats an infeasible one."""
    from types import SimpleNamespace

    from bayesify.train.best import BestState

    net = nn.Linear(2, 2)
    with torch.no_grad():
        net.weight.fill_(1.0)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        net.weight.fill_(2.0)
    best = BestState.__new__(BestState)
    best.state = SimpleNamespace(bnn=net, ctx=SimpleNamespace(is_main=True))
    best.active, best.start_state, best.initial = True, None, start

    def retune():
        at_start = bool(torch.all(net.weight == 1.0))
        nll, shift = (start_nll, start_shift) if at_start else (0.301, 1.8)
        return ({"knob": 0.0 if at_start else 1.0, "val_nll": nll, "val_shift_nll": shift},
                {"val_nll": nll, "val_accuracy": 0.9})

    record = {"kept": "last", "kept_val_nll": 0.301, "kept_val_accuracy": 0.9, "knob": 1.0,
              "val_shift_nll": 1.8, "start_tempered_val_nll": 0.3, "family_val_nll": 0.32}
    best.retry_start(record, retune)
    assert record["kept"] == kept
    assert torch.all(net.weight == (1.0 if kept == "start" else 2.0))
    if kept == "start":
        assert record["kept_val_shift_nll"] == start_shift and record["knob"] == 0.0


def test_only_the_handed_back_states_search_speaks(pretrained, monkeypatch):
    """The search's warnings are about the state it searched: when the never-worse rule hands
    back another state (searched again), the discarded state's are not shown (a held-out
    ConvNeXt's rank1 fit said "the narrowest end of its grid" and "the broadest end" of one
    knob). Each search here adds its own numbered warning, twice (shown once)."""
    from bayesify.train import loop

    net, data = pretrained
    calls = []
    original = loop.search_with_heads

    def numbered(*args, **kwargs):
        calls.append(len(calls) + 1)
        for _ in range(2):
            warnings.warn(f"search {calls[-1]} of this fit", UserWarning, stacklevel=1)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "search_with_heads", numbered)
    bnn = bayesify(net, "ibnn", init_mean_std=0.0, laplace_heads=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit(bnn, data, val_loader=data, lr=5.0, epochs=3, progress=False, seed=0)
    assert result.last["kept"] == "start" and calls == [1, 2]
    said = [str(w.message) for w in caught if str(w.message).startswith("search ")]
    assert said == ["search 2 of this fit"]

    calls.clear()  # a fit that keeps its last state: its one search speaks
    torch.manual_seed(0)  # the initial posterior's draws
    bnn = bayesify(net, "ibnn", laplace_heads=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit(bnn, data, val_loader=data, lr=0.01, epochs=2, progress=False, seed=0)
    assert result.last.get("kept", "last") == "last" and calls == [1]
    assert [str(w.message) for w in caught if str(w.message).startswith("search ")] == \
        ["search 1 of this fit"]

    # with Laplace heads the start is searched with them too (every knob neutral): the
    # search of the state handed back speaks, whichever it is
    for threshold in (math.inf, -math.inf):
        calls.clear()
        monkeypatch.setattr(best_module, "START_SHIFT_SE", threshold)
        torch.manual_seed(0)
        bnn = bayesify(net, "ibnn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fit(bnn, data, val_loader=data, lr=0.01, epochs=2, progress=False, seed=0)
        kept = result.last.get("kept", "last")
        assert kept == ("last" if threshold > 0 else "start") and calls == [1, 2]
        assert [str(w.message) for w in caught if str(w.message).startswith("search ")] == \
            [f"search {1 if kept == 'last' else 2} of this fit"]


@pytest.mark.parametrize("last_accuracy, kept", [(0.85, "epoch 8"), (256 / 300, "last")])
def test_a_state_below_the_searchs_accuracy_tolerance_is_not_handed_back(last_accuracy, kept):
    """BestState.finish: a last state more than one point (the search's accuracy tolerance)
    below the start on validation is only there because no candidate of the search kept the
    accuracy; the lowest-NLL state within the tolerance is kept instead, though the last has
    the better NLL (a held-out depthwise CNN: MNF at 0.8500 against 0.8633 on 300 images,
    NLL 0.436 against a calibrated start of 0.461, 4 examples more than a binomial SD would
    call "clearly worse"). At exactly one point below (3 of 300) the last state stays."""
    from types import SimpleNamespace

    from bayesify.train.best import BestState, accuracy_lost

    net = nn.Linear(2, 2)
    tensors = {w: {k: torch.full_like(v, w) for k, v in net.state_dict().items()}
               for w in (0.0, 1.0)}  # 0: the start, 1: epoch 8's; the net holds the last
    best = BestState.__new__(BestState)
    best.state = SimpleNamespace(bnn=SimpleNamespace(
        load_state_dict=lambda t, strict: net.load_state_dict(t, strict=strict),
        eval=lambda: None), ctx=SimpleNamespace(is_main=True))
    best.active, best.restores, best.start_state, best.weighs_start = True, True, None, False
    best.start = {"accuracy": 259 / 300, "nll": 0.9276, "n": 300}
    best.best, best.best_epoch = tensors[1.0], 8
    best.best_metrics = {"val_nll": 0.684, "val_accuracy": 259 / 300}
    best.initial = tensors[0.0]
    best._validate = lambda t: {"val_nll": 0.9276, "val_accuracy": 259 / 300}
    with torch.no_grad():
        net.weight.fill_(2.0)
    last = {"val_nll": 0.4364, "val_accuracy": last_accuracy, "start_tempered_val_nll": 0.4605}
    best.finish(last, "mnf")
    assert last["kept"] == kept and last["worse_than_start"] is False
    assert float(net.weight[0, 0]) == (1.0 if kept == "epoch 8" else 2.0)
    assert bool(accuracy_lost(best.start, {"val_accuracy": last_accuracy})) == (kept != "last")
    # one example is always allowed (a split of 3 images: 1 flipped is not "lost")
    assert accuracy_lost({"accuracy": 1.0, "n": 3}, {"val_accuracy": 2 / 3}) == []
    assert accuracy_lost({"accuracy": 1.0, "n": 3}, {"val_accuracy": 1 / 3})
