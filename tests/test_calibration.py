"""Temperature scaling: the mixture NLL, its minimiser, the never-worse guarantee."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, ModelPredictor, bayesify, metrics
from bayesify.predict import calibration
from bayesify.predict.calibration import fit_temperature, mixture_nll


def _synthetic(n: int = 1500, m: int = 3, c: int = 6, t_true: float = 2.5, seed: int = 0):
    """Member logits around shared logits z; labels drawn from the tempered mixture
    ``softmax(log p̄ / t_true)`` (the temperature acts on the predictive)."""
    g = torch.Generator().manual_seed(seed)
    z = 3.0 * torch.randn(n, c, generator=g)
    members = z + 0.5 * torch.randn(m, n, c, generator=g)
    probs = (members.softmax(-1).mean(0).log() / t_true).softmax(-1)
    labels = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    return members, labels


def test_mixture_nll_is_the_tempered_predictive_at_every_temperature():
    """−log of p̄^(1/T) / Σ_c p̄^(1/T), p̄ the members' mean probability (brute force in
    float64): the temperature acts on the predictive, not on the members' logits."""
    logits, labels = _synthetic(n=200)
    mean = logits.double().softmax(-1).mean(0)
    for t in (0.3, 1.0, 4.0):
        powered = mean ** (1.0 / t)
        expected = -(powered / powered.sum(-1, keepdim=True)).log()[torch.arange(200), labels]
        got = mixture_nll(logits, labels, torch.tensor(math.log(t))).item()
        assert got == pytest.approx(expected.mean().item(), rel=1e-5)
    member_level = metrics.nll_from_member_logits(logits / 0.3, labels)
    assert mixture_nll(logits, labels, torch.tensor(math.log(0.3))).item() != pytest.approx(
        member_level, rel=1e-3)


def test_fit_temperature_recovers_the_generating_temperature_and_is_stationary():
    logits, labels = _synthetic(t_true=2.5)
    t = fit_temperature(logits, labels)
    assert t == pytest.approx(2.5, rel=0.1)
    log_t = torch.tensor(math.log(t), requires_grad=True)
    mixture_nll(logits, labels, log_t).backward()
    assert abs(log_t.grad.item()) < 1e-3  # first-order optimality in log T
    at = lambda s: mixture_nll(logits, labels, torch.tensor(math.log(s))).item()
    assert at(t) <= min(at(0.9 * t), at(1.1 * t))


def test_fit_temperature_below_one_for_overconfident_members():
    logits, labels = _synthetic(n=4000, t_true=0.4)
    assert fit_temperature(logits, labels) == pytest.approx(0.4, rel=0.1)


def _digits_loader(digits, split: str) -> DataLoader:
    return DataLoader(getattr(digits, split), batch_size=256)


def test_calibrate_lowers_val_nll_and_is_applied_everywhere(digits, digits_map, tmp_path):
    torch.manual_seed(0)
    bnn = bayesify(digits_map, "ibnn", components=2, init_mean_std=0.3)
    predictor = bnn.predictor(samples_per_component=2)
    val = _digits_loader(digits, "val")
    before = predictor.evaluate(val)
    result = predictor.calibrate(val, plot=tmp_path / "rel.png")
    assert result.temperature == predictor.temperature != 1.0
    assert result.nll_after <= result.nll_before
    assert result.nll_before == pytest.approx(before["nll"], rel=1e-5)
    # __call__ and evaluate use the fitted temperature
    after = predictor.evaluate(val)
    assert after["nll"] == pytest.approx(result.nll_after, rel=1e-5)
    assert after["ece"] == pytest.approx(result.ece_after, abs=1e-6)
    x = digits.val.tensors[0][:7]
    raw = predictor.member_logits(x)
    # the temperature acts on the predictive: softmax(log p̄ / T)
    expected = (metrics.mixture_log_probs(raw) / result.temperature).softmax(-1)
    torch.testing.assert_close(predictor(x).probs, expected)
    assert (tmp_path / "rel.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrating_twice_keeps_the_optimum(digits, digits_map):
    predictor = ModelPredictor(digits_map)
    val = _digits_loader(digits, "val")
    first = predictor.calibrate(val)
    second = predictor.calibrate(val)
    assert second.previous_temperature == first.temperature
    assert second.nll_after <= second.nll_before + 1e-7
    assert second.temperature == pytest.approx(first.temperature, rel=1e-3)


def test_a_worse_optimum_keeps_the_previous_temperature(digits, digits_map, monkeypatch):
    predictor = ModelPredictor(digits_map, temperature=1.0)
    monkeypatch.setattr(calibration, "fit_temperature", lambda *a, **k: 1e3)
    result = predictor.calibrate(_digits_loader(digits, "val"), rule="min")
    assert result.kept_previous and result.optimum_temperature == 1e3
    assert predictor.temperature == 1.0
    assert result.nll_after == result.nll_before


def test_one_se_rule_keeps_the_softest_temperature_the_split_cannot_refuse():
    """A perfectly classified split: the NLL optimum runs to hard votes (T → bound);
    the default rule keeps the softest T within one paired standard error of it."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (60,), generator=g)
    logits = torch.randn(1, 60, 4, generator=g)
    logits[0, torch.arange(60), labels] += 4.0  # every example right, moderately confident
    pred = calibration.Prediction(logits)
    optimum = calibration.fit_temperature(logits, labels)
    chosen, curve = calibration.choose_temperature(pred, labels, previous=1.0, optimum=optimum)
    assert optimum < 0.1  # the optimum overfits towards hard votes
    assert optimum < chosen <= 1.0
    nll = dict(zip(curve["temperature_grid"], curve["temperature_val_nll"]))
    assert nll[chosen] <= nll[1.0]


def test_calibration_errors(digits, digits_map):
    predictor = ModelPredictor(digits_map)
    with pytest.raises(BayesifyError, match="unknown calibration method"):
        predictor.calibrate(_digits_loader(digits, "val"), method="isotonic")
    unlabeled = DataLoader(TensorDataset(digits.val.tensors[0]), batch_size=64)
    with pytest.raises(BayesifyError, match=r"\(x, y\)"):
        predictor.calibrate([batch[0] for batch in unlabeled])
    with pytest.raises(BayesifyError, match="negative"):
        predictor.calibrate(_digits_loader(digits, "ood"))
