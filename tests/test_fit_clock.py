"""A default fit says how long it will take before a tenth is done, its budget is counted in
forward passes (not optimiser steps of a tiled batch), and validation between epochs runs
only while it is cheap (issue 37, item 5)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit
from bayesify.train.budget import DEFAULT_FORWARDS, default_epochs, rows_per_example
from bayesify.train.clock import FitClock


def loader(n: int, batch: int = 10, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=batch)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


def test_budget_counts_forward_passes_of_the_familys_rows(monkeypatch):
    monkeypatch.delenv("BAYESIFY_MIN_STEPS", raising=False)
    ibnn = bayesify(net(), "ibnn")  # S = 2 repeats per example
    ens = bayesify(net(), "ensemble", components=4)  # every member sees every example
    assert rows_per_example(ibnn.method.step()) == 2
    assert rows_per_example(ens.method.step()) == 4
    kw = {"batches_per_epoch": 10, "grad_accum_steps": 1, "min_steps": None}
    ibnn_epochs, plan = default_epochs(n_train=300, step=ibnn.method.step(), **kw)
    ens_epochs, _ = default_epochs(n_train=300, step=ens.method.step(), **kw)
    # whole epochs until the budget of forward passes: the same cost for both families
    assert ibnn_epochs == -(-DEFAULT_FORWARDS // 600) and ens_epochs == -(-DEFAULT_FORWARDS // 1200)
    assert (ibnn_epochs - 1) * 600 < DEFAULT_FORWARDS <= ibnn_epochs * 600
    assert "forward passes" in plan
    # a data set larger than the budget: one epoch; min_steps= keeps the step budget
    assert default_epochs(n_train=10**6, step=ibnn.method.step(), **kw)[0] == 1
    assert default_epochs(n_train=300, step=ibnn.method.step(), batches_per_epoch=10,
                          grad_accum_steps=1, min_steps=35)[0] == 4


class Steps:
    """A user callback: the optimiser step the fit is at (called before the clock)."""

    def __init__(self) -> None:
        self.step = 0

    def on_step_end(self, state, terms) -> None:
        self.step = state.global_step


def test_the_expected_duration_is_logged_before_a_tenth_is_done(caplog):
    steps = Steps()
    bnn = bayesify(net(), "ibnn", components=2, predict_samples=1)
    seen: list[int] = []

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("fit: about"):
                seen.append(steps.step)

    spy = Spy()
    logging.getLogger("bayesify.train.clock").addHandler(spy)
    try:
        with caplog.at_level(logging.INFO, logger="bayesify"):
            result = fit(bnn, loader(100), val_loader=loader(20), epochs=4, progress=False,
                         callbacks=[steps])
    finally:
        logging.getLogger("bayesify.train.clock").removeHandler(spy)
    total = sum(h["steps"] for h in result.history)
    assert total == 40 and len(seen) == 1 and 2 <= seen[0] <= total / 10
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("fit: about"))
    assert "40 optimiser steps" in line and "of validation" in line
    assert result[0]["expected_seconds"] > 0


def test_validation_between_epochs_only_while_cheap():
    big_val = loader(400, batch=400, seed=1)  # validation dearer than 2 tiny steps
    options = {"components": 2, "predict_samples": 1}
    bnn = bayesify(net(), "ibnn", **options)
    auto = fit(bnn, loader(20), val_loader=big_val, epochs=3, progress=False)
    assert ["val_nll" in h for h in auto.history] == [False, False, True]  # the last always
    bnn = bayesify(net(), "ibnn", **options)
    every = fit(bnn, loader(20), val_loader=big_val, epochs=3, val_every=1, progress=False)
    assert all("val_nll" in h for h in every.history)


def test_a_cheap_validation_runs_every_epoch():
    """Sets without a length: the schedule falls back to measured seconds."""
    clock = FitClock.__new__(FitClock)
    clock.val_every, clock.train_seconds, clock.val_seconds = None, 0.0, 0.0
    clock.val_estimate, clock.per_epoch_allowance = 1.0, None

    class Ctx:
        distributed = False

    clock.state = type("S", (), {"ctx": Ctx()})()
    assert clock.should_validate({"seconds": 10.0}, epoch=0, is_last=False)  # 1 s ≤ 25 % of 10
    clock.validated(1.0)
    assert clock.should_validate({"seconds": 10.0}, epoch=1, is_last=False)  # 2 ≤ 5
    clock.validated(4.0)
    assert not clock.should_validate({"seconds": 1.0}, epoch=2, is_last=False)  # 9 > 5.25
    assert clock.should_validate({"seconds": 1.0}, epoch=3, is_last=True)


def test_validated_epochs_are_counted_not_timed(monkeypatch):
    """Which epochs are validated follows from the counted work (N_train × rows × 3 per epoch
    against N_val × members per validation), not from seconds: with every validation made to
    look 1,000× dearer the same epochs are validated and the fit ends at the same posterior."""
    from bayesify.train.clock import FitClock as Clock

    def run():
        bnn = bayesify(net(), "ibnn", components=2, predict_samples=1)
        result = fit(bnn, loader(64), val_loader=loader(200, seed=1), epochs=8, progress=False,
                     seed=0)
        return ["val_nll" in h for h in result.history], bnn.posterior_tensors()

    schedule, posterior = run()
    # an epoch is 64 examples × 2 rows × 3 = 384 forward passes, a validation 200 × 2
    # members = 400: 25 % of an epoch is 0.24 validations, one is due after epoch 5
    assert schedule == [False, False, False, False, True, False, False, True]
    validated = Clock.validated
    monkeypatch.setattr(Clock, "validated", lambda self, seconds: validated(self, 1000 * seconds))
    dear, posterior_dear = run()
    assert dear == schedule
    for name in posterior:
        assert torch.equal(posterior[name], posterior_dear[name]), name


def test_the_counted_allowance_spreads_validations_evenly():
    clock = FitClock.__new__(FitClock)
    clock.per_epoch_allowance = 0.3  # one validation per 3⅓ epochs of work
    assert [clock.counted_validation(e) for e in range(10)] == [
        False, False, False, True, False, False, True, False, False, True]


@pytest.mark.parametrize("val_every", [0, 1.5, True])
def test_val_every_is_still_checked(val_every):
    from bayesify.errors import BayesifyError

    with pytest.raises((BayesifyError, TypeError), match="val_every"):
        fit(bayesify(net(), "ibnn"), loader(20), val_every=val_every, progress=False)


def test_the_search_scores_each_perturbation_on_every_third_example():
    from bayesify.core.batch import Batch
    from bayesify.train.tuning import interleaved

    x = torch.arange(7.0)[:, None].repeat(1, 3)
    mask = torch.ones(7, 3, dtype=torch.long)
    copies = [Batch((x + 100 * k,), {"mask": mask * k}, torch.arange(7)) for k in range(3)]
    mixed = interleaved(copies)
    for r in range(7):
        assert torch.equal(mixed.args[0][r], copies[r % 3].args[0][r])
        assert torch.equal(mixed.kwargs["mask"][r], copies[r % 3].kwargs["mask"][r])
    assert torch.equal(mixed.labels, torch.arange(7))


def test_a_default_rate_is_scaled_down_for_batches_below_the_reference():
    from bayesify.train.budget import REFERENCE_BATCH, small_batch_factor

    assert REFERENCE_BATCH == 16
    assert small_batch_factor(examples_per_step=1, optimizer="sgd") == pytest.approx(1 / 16)
    assert small_batch_factor(examples_per_step=4, optimizer="adam") == pytest.approx(0.5)
    assert small_batch_factor(examples_per_step=16, optimizer="sgd") == 1.0
    assert small_batch_factor(examples_per_step=256, optimizer="sgd") == 1.0  # never up
    assert small_batch_factor(examples_per_step=None, optimizer="sgd") == 1.0


def _mean_drift(batch: int, **fit_kw) -> tuple[float, float]:
    """How far mean-field's means move in 4 epochs of 64 examples, and the rate it used."""
    bnn = bayesify(net(), "meanfield")
    start = {n: p.detach().clone() for n, p in bnn.named_parameters() if n.endswith("_mu")}
    result = fit(bnn, loader(64, batch=batch), epochs=4, seed=0, progress=False, **fit_kw)
    moved = sum(float((p.detach() - start[n]).pow(2).sum())
                for n, p in bnn.named_parameters() if n in start) ** 0.5
    return moved, result.history[-1]["lr"]


def test_batches_of_one_move_the_posterior_as_far_as_the_reference_batch(caplog):
    """An epoch of batch-B SGD moves the means ~lr·N/B mean gradients: at the default rate a
    batch of one is scaled by 1/16 and drifts about as far as a batch of 16 (unscaled: many
    times as far — the stress matrix's batch_of_one lost 8 points that way)."""
    default = bayesify(net(), "meanfield").method.step().defaults["lr"]
    ref, lr16 = _mean_drift(16)
    with caplog.at_level(logging.INFO, logger="bayesify.train.loop"):
        scaled, lr1 = _mean_drift(1)
    unscaled, lr_given = _mean_drift(1, lr=default)
    assert lr16 == default and lr1 == pytest.approx(default / 16) and lr_given == default
    assert any("examples per optimiser step" in r.getMessage() for r in caplog.records)
    import bayesify as bz  # a loop of one's own gets the same rate
    assert bz.posterior_lr(bayesify(net(), "meanfield"), batch_size=1) == pytest.approx(lr1)
    assert scaled < 3 * ref < unscaled / 2, (scaled, ref, unscaled)
    # accumulation counts: 16 micro-batches of one are one step of 16 examples
    assert _mean_drift(1, grad_accum_steps=16)[1] == default


@pytest.mark.parametrize("method", ["ibnn", "rank1", "meanfield"])
def test_validating_between_epochs_leaves_the_trajectory_as_it_was(method):
    """Whether an epoch is validated is a timing decision (FitClock); the validation draws
    from the global RNG, which the training steps share, so it ran inside its own fork: the
    same seed trains the same posterior whatever the machine's load (it differed by 0.058)."""
    states = []
    for every in (1, 100):
        torch.manual_seed(0)  # a Dropout in the network: training draws from the global RNG
        base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 2)).eval()
        bnn = bayesify(base, method)
        fit(bnn, loader(64, batch=16), val_loader=loader(64, seed=1), epochs=3, val_every=every,
            progress=False, seed=0)
        states.append({n: p.detach().clone() for n, p in bnn.named_posterior_parameters()})
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name


def test_without_a_batch_size_the_global_batch_is_n_train_over_the_batches_per_epoch():
    """Two ranks, 8 batches each over 64 examples: 8 examples per step, rate × 8/16."""
    from types import SimpleNamespace

    from bayesify.train.loop import _small_batch_lr

    state = SimpleNamespace(grad_accum_steps=1, steps_per_epoch=8,
                            data=SimpleNamespace(global_batch_size=None),
                            ctx=SimpleNamespace(world_size=2, is_main=True))
    assert _small_batch_lr(state, 0.2, n_train=64, optimizer="sgd") == pytest.approx(0.1)
    state.grad_accum_steps = 2  # two such batches a step: 16 examples, no scaling
    assert _small_batch_lr(state, 0.2, n_train=64, optimizer="sgd") == pytest.approx(0.2)
