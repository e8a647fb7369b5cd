"""After a loop of the user's own, ``bayesify.tune(..., start=bayesify.starting_state(bnn))``
weighs the trained state against the network it started from with its Laplace heads, as
``fit(val_loader=...)`` does at its end (``bayesify.train.best.start_with_heads``)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from bayesify import bayesify, fit, starting_state, tune
from bayesify.train import best as best_module
from tests.test_custom_loop import hand_written_loop
from tests.test_registry_state import loader, model


def _val():
    return loader(n=32, seed=1, batch=8)


def _by_hand(method: str = "ensemble"):
    """Two epochs of ``elbo_loss`` steps, as ``fit(lr=0.05, lr_schedule="constant")``."""
    data = loader(n=40, batch=8)
    bnn = bayesify(model(), method)
    start = starting_state(bnn)
    hand_written_loop(bnn, data).eval()
    return bnn, start, data


def _by_fit(method: str = "ensemble"):
    bnn = bayesify(model(), method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        last = fit(bnn, loader(n=40, batch=8), val_loader=_val(), epochs=2, lr=0.05,
                   lr_schedule="constant", seed=0, progress=False).last
    return bnn, last


def _probs(bnn):
    x = _val().dataset.tensors[0][:8]
    with torch.no_grad():
        return bnn.predictive(x).probs


@pytest.mark.parametrize("threshold, kept", [(-math.inf, "start"), (math.inf, "last"),
                                             (best_module.START_SHIFT_SE, None)])
def test_tune_with_the_start_decides_as_fit(monkeypatch, threshold, kept):
    """The same trained posterior (a hand-written loop equals fit: test_custom_loop) and the
    same validation split: tune(start=) keeps what fit keeps, with the same comparison and
    the same predictive."""
    monkeypatch.setattr(best_module, "START_SHIFT_SE", threshold)
    reference, last = _by_fit()
    mine, start, data = _by_hand()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record = tune(mine, _val(), train_loader=data, start=start, progress=False)
    if kept is not None:
        assert record["kept"] == last["kept"] == kept
    else:
        assert record["kept"] == last["kept"]
    assert record["start_heads_shift_z"] == pytest.approx(last["start_heads_shift_z"], abs=1e-6)
    for key in ("temperature", "heads_prior_precision", "member_temperature"):
        assert record[key] == pytest.approx(last[key], rel=1e-6), key
    torch.testing.assert_close(_probs(mine), _probs(reference), atol=1e-6, rtol=1e-5)
    if record["kept"] == "start":  # the members as they began (copies), with the heads
        assert mine.state.value("member_temperature") == 1.0
        for name, p in mine.named_posterior_parameters():
            assert torch.equal(p.detach(), start[f"model.{name}"]), name
        assert record["trained_val_nll"] is not None


def test_tune_without_the_start_keeps_the_trained_state(monkeypatch):
    """Without ``start`` nothing is weighed (the record says so by its absence): a start
    that would win is not consulted."""
    monkeypatch.setattr(best_module, "START_SHIFT_SE", -math.inf)
    mine, _, data = _by_hand()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record = tune(mine, _val(), train_loader=data, progress=False)
    assert "kept" not in record and "start_heads_shift_z" not in record


def test_starting_state_is_the_network_for_the_rank_one_families():
    bnn = bayesify(model(), "rank1")
    start = starting_state(bnn)
    fast = [k for k in start if k.endswith((".r", ".s"))]
    assert fast and all(torch.equal(start[k], torch.ones_like(start[k])) for k in fast)
    assert all(v.device.type == "cpu" for v in start.values())


def test_tune_hands_back_a_feasible_start_where_the_trained_state_is_not():
    """``if_infeasible`` (tune's rule; fit weighs that case in ``retry_start``): a trained
    state above the calibrated start is replaced by a feasible start whatever the shift."""
    from torch import nn

    from bayesify.train.best import start_with_heads

    net = nn.Linear(2, 2)
    trained = {k: v.clone() for k, v in net.state_dict().items()}
    start = {k: v + 1.0 for k, v in trained.items()}
    g = torch.Generator().manual_seed(0)
    family_shift = 1.0 + 0.1 * torch.randn(50, generator=g)

    def neutral():  # the start's search: feasible, the same shifted NLL on average
        scores["shift"] = family_shift + 0.01 * torch.randn(50, generator=g)
        return {"val_nll": 0.301}

    for if_infeasible, adopted in ((False, False), (True, True)):
        scores: dict[str, torch.Tensor] = {}
        record = {"val_nll": 0.40, "start_tempered_val_nll": 0.30, "val_shift_nll": 1.0}
        chosen = start_with_heads(net, record, start, neutral, family_shift, scores,
                                  if_infeasible=if_infeasible)
        assert (chosen is not None) == adopted
        assert abs(record["start_heads_shift_z"]) < 3  # the shift did not decide
        for key, value in net.state_dict().items():
            assert torch.equal(value, start[key] if adopted else trained[key]), key
        net.load_state_dict(trained)
