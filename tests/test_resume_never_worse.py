"""A fit killed and resumed from its checkpoint ends as the uninterrupted one also where the
never-worse rules decide (``bayesify.train.best``, ``bayesify.train.start_guard``): the
checkpoint carries the start's validation metrics and the starting and best states.

Before the checkpoint carried them, a resumed fit had no rule at all: the destructive fits
below were handed back destroyed (a state 10^4 away from the uninterrupted fit's, which kept
its start)."""

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
from bayesify.train.checkpoint import (
    atomic_save,
    content_checksum,
    list_checkpoints,
    load_checkpoint,
)
from tests.pretrained_nets import fit_full_batch
from tests.test_resume import Kill, KillAt


@pytest.fixture(scope="module")
def task():
    torch.manual_seed(0)
    x = torch.randn(200, 4)
    y = (x[:, 0] + 0.5 * torch.randn(200) > 0).long()  # noisy labels: start NLL ≈ 0.26
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    return fit_full_batch(net, net.parameters(), x, y, lr=0.05, steps=60), TensorDataset(x, y)


def _loaders(data):
    return (DataLoader(data, batch_size=50, shuffle=True), DataLoader(data, batch_size=50))


def _bnn(net, method, **config):
    torch.manual_seed(3)  # the initial posterior's draws: the same in every run
    return bayesify(net, method, **config)


def _fit(bnn, data, **options):
    train = _loaders(data)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit(bnn, train, progress=False, seed=0, **options)


def _killed_then_resumed(net, method, data, directory, *, kill_epoch, config=None, **options):
    with pytest.raises(Kill):
        _fit(_bnn(net, method, **(config or {})), data, checkpoint_dir=directory,
             callbacks=[KillAt(epoch=kill_epoch)], **options)
    payload = load_checkpoint(list_checkpoints(directory)[-1])  # what the resume reads
    assert payload["meta"]["epoch"] == kill_epoch
    torch.manual_seed(999)  # a new process: another global RNG state
    bnn = _bnn(net, method, **(config or {}))
    return bnn, _fit(bnn, data, checkpoint_dir=directory, resume=directory, **options), payload


def _assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


RECORD = ("kept", "kept_val_nll", "kept_val_accuracy", "temperature", "worse_than_start")


@pytest.mark.parametrize("method, lr, schedule, kept", [
    ("ibnn", 5.0, "constant", "start"),  # destroyed: the start
    ("meanfield", 0.005, "linear:2:4:200", "epoch 1"),  # the best earlier epoch's tensors
    ("rank1", 0.2, "linear:2:4:50", "epoch 2"),
])
def test_a_resumed_fit_keeps_what_the_uninterrupted_fit_keeps(task, tmp_path, method, lr,
                                                               schedule, kept):
    net, data = task
    val = _loaders(data)[1]
    options = {"val_loader": val, "epochs": 4, "val_every": 1, "lr": lr, "lr_schedule": schedule}
    full = _bnn(net, method)
    reference = _fit(full, data, **options)
    whole = reference.last
    assert whole["kept"] == kept  # the rule acted, on the state this case is about
    resumed, result, payload = _killed_then_resumed(net, method, data, tmp_path, kill_epoch=2,
                                                    **options)
    assert [r["epoch"] for r in result.history] == [1, 2, 3, 4]
    for key in RECORD:
        assert result.last[key] == whole[key], key
    start_nll = reference.history[0]["start_val_nll"]
    assert result.history[0]["start_val_nll"] == start_nll
    _assert_same(full, resumed)
    # what the checkpoint of epoch 2 held for it
    carried = payload["meta"]["carried"]["best"]
    assert carried["start"]["nll"] == start_nll
    assert "initial" in payload["carried"]["best"]
    if kept.startswith("epoch"):
        assert carried["best_epoch"] == int(kept.split()[1])
        assert "best" in payload["carried"]["best"]


def test_a_resumed_fit_weighs_the_start_with_heads_as_the_uninterrupted_one(task, tmp_path,
                                                                           monkeypatch):
    """Threshold −inf: any feasible start with heads replaces the trained state — after a
    resume too (the start's tensors came from the checkpoint)."""
    net, data = task
    monkeypatch.setattr(best_module, "START_SHIFT_SE", -math.inf)
    options = {"val_loader": _loaders(data)[1], "epochs": 3, "val_every": 1}
    full = _bnn(net, "ibnn")
    whole = _fit(full, data, **options).last
    assert whole["kept"] == "start" and "start_heads_shift_z" in whole
    resumed, result, _ = _killed_then_resumed(net, "ibnn", data, tmp_path, kill_epoch=1,
                                              **options)
    for key in (*RECORD, "start_heads_shift_z", "heads_prior_precision"):
        assert result.last[key] == whole[key], key
    _assert_same(full, resumed)


def test_without_validation_a_resumed_fit_keeps_the_training_accuracy_guard(tmp_path):
    """The start guard's rows are drawn the same way in both runs and the start's count is
    taken again from the carried starting state (``test_start_guard``'s destructive fit)."""
    from tests.test_start_guard import _pretrained, _task

    net = _pretrained(_task())

    def run(**options):
        torch.manual_seed(3)
        bnn = bayesify(net, "meanfield", per_network=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bnn, fit(bnn, _task(), epochs=3, lr=0.5, progress=False, seed=0, **options)

    full, whole = run()
    assert whole.last["kept"] == "start"
    with pytest.raises(Kill):
        run(checkpoint_dir=tmp_path, callbacks=[KillAt(epoch=1)])
    payload = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert payload["meta"]["carried"]["start_guard"] == {"active": True}
    assert "initial" in payload["carried"]["start_guard"]
    torch.manual_seed(999)
    resumed, result = run(checkpoint_dir=tmp_path, resume=tmp_path)
    for key in ("kept", "start_train_accuracy", "end_train_accuracy"):
        assert result.last[key] == whole.last[key], key
    _assert_same(full, resumed)


def test_a_finished_run_resumed_is_the_kept_state_and_decides_nothing_again(task, tmp_path):
    net, data = task
    options = {"val_loader": _loaders(data)[1], "epochs": 2, "val_every": 1, "lr": 5.0}
    full = _bnn(net, "ibnn")
    whole = _fit(full, data, checkpoint_dir=tmp_path, **options).last
    assert whole["kept"] == "start"
    again = _bnn(net, "ibnn")
    result = _fit(again, data, resume=tmp_path, **options)
    assert result.last["kept"] == "start" and len(result.history) == 2
    _assert_same(full, again)


def test_a_checkpoint_without_the_rules_state_resumes_without_the_rule(task, tmp_path):
    """A checkpoint written before the rules were carried (no ``carried`` section) is still
    read; the resumed fit then has no start to compare with, as before."""
    net, data = task
    options = {"val_loader": _loaders(data)[1], "epochs": 3, "val_every": 1, "lr": 5.0}
    with pytest.raises(Kill):
        _fit(_bnn(net, "ibnn"), data, checkpoint_dir=tmp_path, callbacks=[KillAt(epoch=1)],
             **options)
    path = list_checkpoints(tmp_path)[-1]
    raw = torch.load(path, weights_only=True)
    raw.pop("carried")
    meta = json.loads(raw["meta"])
    meta.pop("carried")
    raw["meta"] = json.dumps(meta)
    raw["checksum"] = content_checksum(raw)
    atomic_save(raw, path)
    result = _fit(_bnn(net, "ibnn"), data, resume=path, **options)
    assert "kept" not in result.last and "start_val_nll" not in result.history[0]
