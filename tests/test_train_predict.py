"""Trainer, predictor evaluation, data protocol and the demo."""

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, ModelPredictor, NonFiniteLossError, bayesify, fit
from bayesify.data.digits import digits_loaders, load_digits_splits
from bayesify.train.schedules import beta_schedule, lr_factor


def test_digits_protocol_splits():
    s = load_digits_splits(seed=0)
    assert s.num_classes == 5 and s.image_shape == (1, 8, 8)
    sizes = [len(d) for d in (s.train, s.val, s.test)]
    assert sum(sizes) == 901  # digits 0–4 in scikit-learn's digits
    assert set(s.train.tensors[1].tolist()) == set(range(5))
    assert (s.ood.tensors[1] == -1).all() and len(s.ood) > 800
    # stratified: class proportions equal across splits within 2 points
    for d in (s.val, s.test):
        frac = torch.bincount(d.tensors[1], minlength=5).float() / len(d)
        ref = torch.bincount(s.train.tensors[1], minlength=5).float() / len(s.train)
        assert (frac - ref).abs().max() < 0.02
    big = load_digits_splits(seed=0, size=32, channels=3)
    assert big.image_shape == (3, 32, 32)
    assert torch.equal(load_digits_splits(seed=0).train.tensors[0], s.train.tensors[0])


def test_fit_reduces_loss_and_logs(tmp_path, digits, digits_map):
    loaders = digits_loaders(digits, batch_size=64, seed=0)
    bnn = bayesify(digits_map, "ibnn", components=2, samples=1, init_mean_std=0.5)
    before = bnn.predictor().evaluate(loaders["val"])["nll"]
    result = fit(bnn, loaders["train"], epochs=3, kl_anneal_epochs=2, log_dir=tmp_path,
                 progress=False)
    assert len(result) == 3 and result.history[0]["beta"] < result.history[2]["beta"] == 1.0
    after = bnn.predictor().evaluate(loaders["val"])["nll"]
    assert after < before
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]
    assert {"loss", "nll", "kl", "beta", "lr"} <= set(json.loads(lines[0]))
    assert all(not p.requires_grad for p in bnn.base_parameters())


def test_loss_is_nll_plus_beta_kl_over_n(digits_map):
    from bayesify.train.loop import TrainState, train_step

    bnn = bayesify(digits_map, "ibnn", components=2, samples=1)
    opt = torch.optim.SGD(bnn.posterior_parameters(), lr=0.0)
    state = TrainState(bnn=bnn, optimizer=opt, base_lrs=[0.0], schedules=["constant"], epochs=1,
                       steps_per_epoch=1, n_train=500, kl_anneal_epochs=0, beta_max=0.5)
    x, y = torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)
    terms = train_step(state, x, y)
    assert terms["loss"] == pytest.approx(terms["nll"] + 0.5 * terms["kl"] / 500, rel=1e-5)


def test_base_lr_unfreezes_base(digits, digits_map):
    loaders = digits_loaders(digits, batch_size=128, seed=0)
    bnn = bayesify(digits_map, "ibnn", components=2, samples=1)
    w0 = bnn.model.fc.base_layer.weight.clone()
    fit(bnn, loaders["train"], epochs=1, base_lr=1e-2, progress=False)
    assert not torch.equal(w0, bnn.model.fc.base_layer.weight)


def test_nonfinite_loss_is_a_clear_error(digits_map):
    x = torch.full((8, 1, 8, 8), float("nan"))
    loader = DataLoader(TensorDataset(x, torch.zeros(8, dtype=torch.long)), batch_size=4)
    bnn = bayesify(digits_map, "ibnn", components=2)
    with pytest.raises(NonFiniteLossError, match="epoch 0, step 0"):
        fit(bnn, loader, epochs=1, progress=False)
    with pytest.raises(BayesifyError, match="epochs must be positive"):
        fit(bnn, loader, epochs=0, progress=False)


def test_schedules():
    assert beta_schedule(0.5, anneal_epochs=2) == 0.25
    assert beta_schedule(5, anneal_epochs=2) == 1.0
    assert beta_schedule(0.0, anneal_epochs=0) == 1.0
    assert lr_factor(3, ("linear", 6, 10, 0.25), epochs=15) == 1.0
    assert lr_factor(8, ("linear", 6, 10, 0.25), epochs=15) == pytest.approx(0.625)
    assert lr_factor(12, ("linear", 6, 10, 0.25), epochs=15) == 0.25
    assert lr_factor(15, "cosine", epochs=15) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(BayesifyError):
        lr_factor(1, "wiggly", epochs=2)


def test_evaluate_keys_and_map_predictor(digits, digits_map):
    loaders = digits_loaders(digits, batch_size=64, seed=0)
    out = ModelPredictor(digits_map).evaluate(loaders["test"], loaders["ood"])
    assert out["members"] == 1 and out["epistemic"] < 1e-6
    for key in ("accuracy", "nll", "ece", "brier", "ood_auroc_entropy"):
        assert 0.0 <= out[key] <= 10.0
    assert out["ood_auroc_mi"] is None  # one network: its MI carries no signal (n/a)
    assert out["accuracy"] > 0.9
    bnn = bayesify(digits_map, "ibnn", components=2)
    stats = bnn.predictor(samples_per_component=2).evaluate(loaders["test"], loaders["ood"])
    assert stats["members"] == 4 and stats["epistemic"] > 0
    assert stats["entropy"] == pytest.approx(stats["aleatoric"] + stats["epistemic"], rel=1e-4)


def test_demo_writes_results_and_pngs(tmp_path, capsys):
    from bayesify.cli import main
    from bayesify.demo import HIGHER_IS_BETTER

    assert main(["demo", "--out", str(tmp_path), "--map-epochs", "3", "--epochs", "1",
                 "--no-progress"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"map", "ibnn", "laplace"}  # the default and the recommended family
    for row in results.values():
        assert {"accuracy", "nll", "ece", "brier", "ood_auroc_entropy", "corrupt_nll"} <= set(row)
    assert (tmp_path / "reliability.png").stat().st_size > 1000
    assert (tmp_path / "uncertainty_hist.png").stat().st_size > 1000
    # the printed verdict says in words where the posterior loses to MAP (issue 37.2)
    printed = capsys.readouterr().out
    verdict = next(line for line in printed.splitlines() if line.startswith("ibnn vs map:"))
    losses = [m for m, higher in HIGHER_IS_BETTER.items()
              if isinstance(results["map"].get(m), float)
              and round(results["ibnn"][m], 4) != round(results["map"][m], 4)
              and (results["ibnn"][m] > results["map"][m]) != higher]
    for metric in losses:
        assert metric in verdict.split("worse on")[1].split(";")[0]
    assert ("worse than the MAP network" in printed) == bool(losses)
    assert "demo took" in printed
