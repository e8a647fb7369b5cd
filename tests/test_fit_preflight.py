"""What ``fit`` checks before its first step (issue 35, items 10 and 11).

- every output location (``checkpoint_dir``, ``log_dir``) is probed for real: a
  read-only directory (a real read-only mount where the test may mount one), a path
  that is a regular file or lies under one is refused before any step has trained;
- resume refuses a run whose sampler shuffles differently, whose ``bn_train`` differs
  or that lacks the ``val_loader`` it was started with, naming what changed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit
from bayesify.train import resume as ckpt


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).eval()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


class CountSteps:
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, state, terms) -> None:
        self.steps += 1


def _fit(out: dict, **options):
    bnn = bayesify(model(), "ibnn", components=2)
    before = {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}
    counter = CountSteps()
    try:
        return fit(bnn, DataLoader(data(), batch_size=8, shuffle=True), epochs=1,
                   progress=False, callbacks=[counter], **options)
    finally:
        out["steps"] = counter.steps
        out["unchanged"] = all(torch.equal(p, before[n]) for n, p in bnn.named_posterior_parameters())


@contextlib.contextmanager
def read_only_directory(tmp_path: Path):
    """A directory nothing can be written to: a read-only tmpfs mount when this process
    may mount one, else chmod 0o555 (honoured by non-root users)."""
    target = tmp_path / "readonly"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)],
                             capture_output=True, check=False).returncode == 0
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root without permission to mount: no read-only directory to test")
        target.chmod(0o555)
    try:
        yield target
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], check=False)
        else:
            target.chmod(0o755)


def test_a_read_only_checkpoint_dir_is_refused_before_the_first_step(tmp_path):
    with read_only_directory(tmp_path) as target:
        with pytest.raises(OSError):
            (target / "probe").write_text("x")  # really read-only
        for where in (target, target / "run"):
            out: dict = {}
            with pytest.raises(BayesifyError, match="checkpoint_dir=.*cannot be written") as err:
                _fit(out, checkpoint_dir=where)
            assert "writable directory" in str(err.value)
            assert out == {"steps": 0, "unchanged": True}
        out = {}
        with pytest.raises(BayesifyError, match="log_dir=.*cannot be written"):
            _fit(out, log_dir=target / "logs")
        assert out["steps"] == 0


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_the_first_step(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("the user's file")
    for where, match in ((plain, "is a file, not a directory"),
                         (plain / "run", "cannot be written")):
        out: dict = {}
        with pytest.raises(BayesifyError, match=f"checkpoint_dir=.*{match}"):
            _fit(out, checkpoint_dir=where)
        assert out == {"steps": 0, "unchanged": True}
    assert plain.read_text() == "the user's file"
    out = {}
    with pytest.raises(BayesifyError, match="log_dir="):
        _fit(out, log_dir=plain)
    assert out["steps"] == 0


def test_probe_reports_a_full_or_read_only_file_system(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.tempfile, "mkstemp", refuse)
    problem = ckpt.probe_directory(tmp_path / "ckpt", what="checkpoint_dir")
    assert "No space left on device" in problem
    assert list((tmp_path / "ckpt").iterdir()) == []  # the probe leaves nothing behind


class KillAfterSteps:
    def __init__(self, steps: int) -> None:
        self.limit, self.steps = steps, 0

    def on_step_end(self, state, terms) -> None:
        self.steps += 1
        if self.steps == self.limit:
            raise KeyboardInterrupt


def _interrupted_run(tmp_path: Path, *, shuffle: bool, bn_train: bool, val: bool) -> Path:
    directory = tmp_path / "ckpt"
    bnn = bayesify(model(), "ibnn", components=2)
    bnn.bn_train = bn_train
    train = DataLoader(data(), batch_size=8, shuffle=shuffle)
    with pytest.raises(KeyboardInterrupt):
        fit(bnn, train, epochs=2, progress=False, checkpoint_dir=directory,
            checkpoint_every_steps=2, callbacks=[KillAfterSteps(3)],
            val_loader=DataLoader(data(), batch_size=16) if val else None)
    return directory


@pytest.mark.parametrize("change, match", [
    ("shuffle", r"shuffle \(the training loader shuffles\): True in the checkpointed run, False now"),
    ("bn_train", r"bn_train \(BatchNorm statistics train\): False in the checkpointed run, True now"),
    ("val_loader", r"val_loader \(a validation loader is given\): True .*, False now .*validation"),
], ids=["shuffle", "bn_train", "val_loader"])
def test_resume_refuses_a_changed_sampler_bn_train_or_missing_val_loader(tmp_path, change, match):
    directory = _interrupted_run(tmp_path, shuffle=True, bn_train=False, val=True)
    settings = {"shuffle": True, "bn_train": False, "val": True}
    settings[{"val_loader": "val"}.get(change, change)] = not settings[
        {"val_loader": "val"}.get(change, change)]
    bnn = bayesify(model(), "ibnn", components=2)
    bnn.bn_train = settings["bn_train"]
    before = {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}
    with pytest.raises(BayesifyError, match=match):
        fit(bnn, DataLoader(data(), batch_size=8, shuffle=settings["shuffle"]), epochs=2,
            progress=False, resume=directory,
            val_loader=DataLoader(data(), batch_size=16) if settings["val"] else None)
    assert all(torch.equal(p, before[n]) for n, p in bnn.named_posterior_parameters())


def test_resume_with_the_same_settings_still_continues(tmp_path):
    directory = _interrupted_run(tmp_path, shuffle=True, bn_train=False, val=False)
    bnn = bayesify(model(), "ibnn", components=2)
    result = fit(bnn, DataLoader(data(), batch_size=8, shuffle=True), epochs=2, progress=False,
                 resume=directory)
    assert [r["epoch"] for r in result.history] == [1, 2]
