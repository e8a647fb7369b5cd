"""Checkpoint / resume of ``bayesify.fit`` (single process; the DDP case is in test_ddp).

A run killed after epoch e (or mid-epoch) and resumed from its checkpoint must end
with the same posterior as the uninterrupted run; broken, foreign or mismatched
checkpoints are clear errors; a failed write never damages the previous file.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, NonFiniteLossError, bayesify, fit
from bayesify.data.models import DigitsCNN
from bayesify.train import checkpoint as ckpt_mod
from bayesify.train.checkpoint import list_checkpoints, load_checkpoint

OPTS = {"epochs": 3, "lr": 0.1, "base_lr": 0.01, "kl_anneal_epochs": 2,
        "lr_schedule": "linear:1:3:0.5", "base_lr_schedule": "cosine", "seed": 11,
        "progress": False}


class Kill(Exception):
    pass


class KillAt:
    """Raises after the checkpoint of epoch ``epoch`` / optimiser step ``step`` is written."""

    def __init__(self, *, epoch: int | None = None, step: int | None = None) -> None:
        self.epoch, self.step = epoch, step

    def on_epoch_end(self, state, record) -> None:
        if state.epoch == self.epoch:
            raise Kill

    def on_step_end(self, state, terms) -> None:
        if state.global_step == self.step:
            raise Kill


@pytest.fixture(scope="module")
def data(digits):
    x, y = digits.train.tensors
    return TensorDataset(x[:200], y[:200])


def base_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return DigitsCNN(num_classes=5, width=8).eval()


def make_bnn(base=None, seed: int = 1, **options):
    torch.manual_seed(seed)
    options = {"components": 2, "samples": 2, **options}
    return bayesify(base if base is not None else base_model(), "ibnn", **options)


def loader(data) -> DataLoader:
    return DataLoader(data, batch_size=32, shuffle=True)


def state_of(bnn) -> dict[str, torch.Tensor]:
    out = {f"q.{n}": p.detach().clone() for n, p in bnn.named_posterior_parameters()}
    out.update({f"w.{n}": p.detach().clone() for n, p in bnn.named_base_parameters()})
    # the knobs and temperature too (without validation the spread guard sets the knob)
    out.update({f"s.{n}": b.detach().clone().double() for n, b in bnn.state.named_buffers()})
    return out


def max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    directory = tmp_path_factory.mktemp("full")
    bnn = make_bnn()
    result = fit(bnn, loader(data), checkpoint_dir=directory, log_dir=directory, **OPTS)
    return state_of(bnn), result, directory


def test_resume_after_epoch_equals_uninterrupted(data, tmp_path, uninterrupted):
    full, full_result, _ = uninterrupted
    with pytest.raises(Kill):
        fit(make_bnn(), loader(data), checkpoint_dir=tmp_path, log_dir=tmp_path,
            callbacks=[KillAt(epoch=1)], **OPTS)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["epoch0001-step00000007.ckpt"]
    torch.manual_seed(999)  # a new process: other global RNG state, other posterior init
    bnn = make_bnn(seed=5)
    result = fit(bnn, loader(data), checkpoint_dir=tmp_path, log_dir=tmp_path,
                 resume=tmp_path, **OPTS)
    assert max_diff(state_of(bnn), full) <= 1e-6
    assert [r["epoch"] for r in result.history] == [1, 2, 3]
    for got, ref in zip(result.history, full_result.history):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert got["beta"] == ref["beta"] and got["lr"] == ref["lr"]
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]


def test_resume_mid_epoch_equals_uninterrupted(data, tmp_path, uninterrupted):
    full = uninterrupted[0]
    with pytest.raises(Kill):  # killed at optimiser step 12 (epoch 1, batch 5 of 7)
        fit(make_bnn(), loader(data), checkpoint_dir=tmp_path, checkpoint_every_steps=5,
            keep_checkpoints=2, callbacks=[KillAt(step=12)], **OPTS)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["epoch0001-step00000007.ckpt", "epoch0001-step00000010.ckpt"]  # pruned
    meta = load_checkpoint(tmp_path / names[-1])["meta"]
    assert (meta["epoch"], meta["step"], meta["global_step"]) == (1, 3, 10)
    bnn = make_bnn(seed=6)
    fit(bnn, loader(data), resume=tmp_path / names[-1], **OPTS)
    assert max_diff(state_of(bnn), full) <= 1e-6


def test_checkpoint_holds_what_resume_needs(uninterrupted):
    _, _, directory = uninterrupted
    path = list_checkpoints(directory)[-1]
    raw = torch.load(path, weights_only=True)  # nothing but tensors and plain containers
    assert raw["format"] == "bayesify-checkpoint"
    payload = load_checkpoint(path)
    meta = payload["meta"]
    assert meta["epoch"] == 3 and meta["identity"]["method"] == "ibnn"
    assert meta["options"]["lr_schedule"] == ["linear", 1.0, 3.0, 0.5]
    assert set(payload["rng"][0]) == {"cpu", "noise"}
    assert payload["base"] and payload["optimizer"]["state"]  # trainable base + momentum
    assert not any(p.name.startswith(".") for p in directory.iterdir())  # no temp files left


def test_corrupt_and_foreign_checkpoints_are_clear_errors(data, tmp_path, uninterrupted):
    _, _, directory = uninterrupted
    good = list_checkpoints(directory)[-1].read_bytes()
    broken = tmp_path / "epoch0003-step00000021.ckpt"
    broken.write_bytes(good[: len(good) // 2])
    with pytest.raises(BayesifyError, match="corrupt or unreadable"):
        fit(make_bnn(), loader(data), resume=tmp_path, **OPTS)
    torch.save({"weights": torch.zeros(2)}, broken)
    with pytest.raises(BayesifyError, match="not a bayesify training checkpoint"):
        fit(make_bnn(), loader(data), resume=broken, **OPTS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BayesifyError, match="holds no"):
        fit(make_bnn(), loader(data), resume=tmp_path / "empty", **OPTS)
    with pytest.raises(BayesifyError, match="neither a checkpoint file nor a directory"):
        fit(make_bnn(), loader(data), resume=tmp_path / "nothing-here", **OPTS)


def test_mismatched_checkpoints_are_refused(data, uninterrupted):
    _, _, directory = uninterrupted
    with pytest.raises(BayesifyError, match=r"config differs in \['components'\]"):
        fit(make_bnn(components=3), loader(data), resume=directory, **OPTS)
    with pytest.raises(BayesifyError, match="fit option lr: checkpoint 0.1, now 0.2"):
        fit(make_bnn(), loader(data), resume=directory, **{**OPTS, "lr": 0.2})
    with pytest.raises(BayesifyError, match="frozen base weights differ|trainable base"):
        fit(make_bnn(base_model(seed=3)), loader(data), resume=directory,
            **{**OPTS, "base_lr": 0.0})
    frozen = {**OPTS, "base_lr": 0.0}
    with pytest.raises(BayesifyError, match="fit option base_lr"):
        fit(make_bnn(), loader(data), resume=directory, **frozen)


def test_failed_write_keeps_the_previous_checkpoint(data, tmp_path, monkeypatch):
    real_save = torch.save
    calls = {"n": 0}

    def flaky_save(obj, fh, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint: half-written, then the disk "fails"
            fh.write(b"partial")
            raise OSError("No space left on device")
        return real_save(obj, fh, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod.torch, "save", flaky_save)
    with pytest.raises(BayesifyError, match="No space left.*untouched"):
        fit(make_bnn(), loader(data), checkpoint_dir=tmp_path, **OPTS)
    monkeypatch.setattr(ckpt_mod.torch, "save", real_save)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["epoch0001-step00000007.ckpt"]  # no temp file, the good one intact
    assert load_checkpoint(tmp_path / files[0])["meta"]["epoch"] == 1


def test_nonfinite_loss_names_the_step_and_keeps_last_good_checkpoint(data, tmp_path):
    x, y = data.tensors
    x = x.clone()
    x[100] = float("nan")  # batch 3 of epoch 0 in this unshuffled order
    bad = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)
    bnn = make_bnn()
    with pytest.raises(NonFiniteLossError, match="epoch 0, step 3"):
        fit(bnn, bad, checkpoint_dir=tmp_path, checkpoint_every_steps=1,
            **{**OPTS, "epochs": 1})
    last = list_checkpoints(tmp_path)[-1]
    assert last.name == "epoch0000-step00000003.ckpt"
    saved = load_checkpoint(last)["posterior"]
    for name, p in bnn.named_posterior_parameters():  # the failed step changed nothing
        assert torch.equal(saved[name], p.detach())
        assert torch.isfinite(p).all()
