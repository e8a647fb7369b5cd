"""Buffers never escape the guards: no NaN/inf/overflowing statistic survives a step or reaches a file.

BatchNorm statistics change during the *forward* of a training step (``bn_train``,
per-member BatchNorm), so the step guard copies them before the forward and puts
them back with the parameters; checkpoint and posterior writers check every buffer.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, NonFiniteLossError, bayesify, fit, load_posterior
from bayesify.data.models import DigitsCNN
from bayesify.train import checkpoint as C
from bayesify.train.guard import unusable

OPTS = {"lr": 0.05, "seed": 3, "progress": False}


@pytest.fixture(scope="module")
def data(digits):
    x, y = digits.train.tensors
    keep = y < 5
    return x[keep][:96].clone(), y[keep][:96].clone()


def loader(x, y, batch_size=32) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def make(method="ibnn", **options):
    torch.manual_seed(0)
    base = DigitsCNN(num_classes=5, width=4).eval()
    bnn = bayesify(base, method, **options)
    bnn.bn_train = True
    return bnn


def buffers(bnn) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in bnn.named_buffers()}


def all_usable(bnn) -> bool:
    return not any(unusable(t) for t in [*bnn.parameters(), *bnn.buffers()])


class Snapshot:
    """Records buffers and parameters after every optimiser step."""

    def __init__(self, bnn) -> None:
        self.bnn, self.state = bnn, None

    def on_step_end(self, state, terms) -> None:
        self.state = ({n: t.detach().clone() for n, t in self.bnn.state_dict().items()})


FAMILIES = [("ibnn", {"components": 2}),
            ("rank1", {"components": 2, "per_member_bn": True}),
            ("batchensemble", {"components": 2, "per_member_bn": True}),
            ("ensemble", {"components": 2, "per_member_bn": True}),
            ("meanfield", {})]


@pytest.mark.parametrize(("method", "options"), FAMILIES)
@pytest.mark.parametrize("poison", ["inf", "nan"])
def test_a_poisoned_batch_leaves_the_last_usable_state_in_memory(data, method, options, poison):
    x, y = data
    x = x.clone()
    x[70, 0, 3, 3] = {"inf": float("inf"), "nan": float("nan")}[poison]  # one pixel of batch 2
    bnn = make(method, **options)
    snap = Snapshot(bnn)
    with pytest.raises(NonFiniteLossError) as info:
        fit(bnn, loader(x, y), epochs=1, callbacks=[snap], **OPTS)
    assert isinstance(info.value, BayesifyError)
    assert "step 2" in str(info.value)
    after = bnn.state_dict()
    for name, value in snap.state.items():  # exactly the state after step 1
        assert torch.equal(after[name], value), name
    assert all_usable(bnn)
    probs = bnn.predictor()(x[:8]).probs
    assert bool(torch.isfinite(probs).all())


@pytest.mark.parametrize(("method", "options"), FAMILIES)
def test_a_huge_batch_is_undone_and_the_fit_goes_on(data, method, options, caplog):
    """A whole finite batch of 1e20 overflows the BatchNorm statistics of its forward: the
    step guard undoes it (parameters and buffers), halves the learning rate, says so, and
    the fit goes on with the next batch."""
    x, y = data
    x = x.clone()
    x[64:] = 1e20  # batch 2 (the last)
    bnn = make(method, **options)
    with caplog.at_level("WARNING", logger="bayesify.train.guard"):
        fit(bnn, loader(x, y), epochs=2, **OPTS)
    said = [r.getMessage() for r in caplog.records if r.name == "bayesify.train.guard"]
    assert len(said) == 2 and all("halved the learning rate" in m for m in said), said
    assert f"{method}:" in said[0] and "epoch 0, step 2" in said[0] and "epoch 1, step 2" in said[1]
    assert all_usable(bnn)
    assert bool(torch.isfinite(bnn.predictor()(x[:8]).probs).all())


def test_a_huge_batch_every_step_gives_up_after_the_recoveries(data):
    x, y = data
    bnn = make()
    with pytest.raises(NonFiniteLossError, match=r"after 6 recoveries.*halved the learning rate"):
        fit(bnn, loader(torch.full_like(x, 1e20), y), epochs=3, **OPTS)
    assert all_usable(bnn)


def test_a_huge_batch_never_reaches_a_checkpoint(data, tmp_path):
    x, y = data
    x = x.clone()
    x[64:] = 1e20
    bnn = make()
    fit(bnn, loader(x, y), epochs=1, checkpoint_dir=tmp_path, checkpoint_every_steps=1, **OPTS)
    files = C.list_checkpoints(tmp_path)
    assert files and files[-1].name.startswith("epoch0001")  # the epoch's end, after step 2
    for path in files:
        payload = C.load_checkpoint(path)
        assert not any(unusable(t) for t in payload["buffers"].values())
    bnn.save_posterior(tmp_path / "post")  # the state in memory is the usable one
    assert all_usable(load_posterior(make().unwrap(), tmp_path / "post"))


class _PoisonBuffer:
    """A callback that breaks a BatchNorm statistic behind the guard's back."""

    def __init__(self, bnn, value: float) -> None:
        self.bnn, self.value = bnn, value

    def on_step_end(self, state, terms) -> None:
        if state.global_step == 3:  # after the last step, before the epoch's checkpoint
            with torch.no_grad():
                self.bnn.model.features[1].running_var[0] = self.value


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e36])
def test_checkpoint_writes_refuse_unusable_buffers(data, tmp_path, value):
    x, y = data
    bnn = make()
    bnn.bn_train = False
    with pytest.raises(NonFiniteLossError, match=r"buffers\.model\.features\.1"):
        fit(bnn, loader(x, y), epochs=1, checkpoint_dir=tmp_path,
            callbacks=[_PoisonBuffer(bnn, value)], **OPTS)
    assert C.list_checkpoints(tmp_path) == []
    with pytest.raises(BayesifyError, match="NaN/inf"):
        bnn.save_posterior(tmp_path / "post")
    assert not (tmp_path / "post" / "bayesify.json").exists()


def test_a_resealed_checkpoint_with_an_inf_buffer_is_not_resumed(data, tmp_path):
    x, y = data
    bnn = make()
    fit(bnn, loader(x, y), epochs=1, checkpoint_dir=tmp_path, **OPTS)
    path = C.list_checkpoints(tmp_path)[-1]
    payload = torch.load(path, weights_only=True)
    name = next(n for n in payload["buffers"] if n.endswith("running_var"))
    payload["buffers"][name][0] = float("inf")
    payload["checksum"] = C.content_checksum(payload)
    torch.save(payload, path)
    with pytest.raises(BayesifyError, match=f"buffers.{name}"):
        C.load_checkpoint(path)


def test_the_curvature_pass_refuses_non_finite_inputs_before_accumulating(data):
    x, y = data
    x = x.clone()
    x[40, 0, 0, 0] = float("nan")
    torch.manual_seed(0)
    bnn = bayesify(DigitsCNN(num_classes=5, width=4).eval(), "laplace")
    before = buffers(bnn)
    with pytest.raises(BayesifyError, match="NaN"):
        fit(bnn, loader(x, y), progress=False)
    after = buffers(bnn)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_the_guard_copies_the_trainable_tensors_only_where_the_anchor_cannot_restore_them():
    """``before_update`` skips its per-step copy when the anchor holds the same tensors (a
    recovery puts the anchor back anyway); where it does not (no anchor, other tensors), the
    copy is made and ``rollback`` restores the pre-step values."""
    from bayesify.train.guard import StepGuard

    bnn = make("ibnn", components=2)
    params = [p for p in bnn.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    guard = StepGuard(bnn)
    guard.begin()
    guard.before_update(params)  # no anchor yet: copied
    assert guard.params_copied
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    guard.rollback()
    assert all(torch.equal(p, b) for p, b in zip(params, before))

    guard.keep_anchor(params, 0)
    guard.before_update(params)  # the anchor holds these tensors: no copy
    assert not guard.params_copied
    with torch.no_grad():
        for p in params:
            p.fill_(float("nan"))
    guard.rollback()  # buffers only
    assert guard.rollback_to_anchor(params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))

    guard.before_update(params[:-1])  # other tensors than the anchor's: copied again
    assert guard.params_copied and not guard.anchor_restorable(params[:-1])
