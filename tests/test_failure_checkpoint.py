"""Training checkpoints: damaged content is never used, non-finite state never written.

Small iBNN on 5-class digits, 3 epochs of 2 steps, a checkpoint after every
optimiser step. Each test damages one thing and checks what ``fit(resume=...)``
does with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, NonFiniteLossError, bayesify, fit
from bayesify.data.models import DigitsCNN
from bayesify.train import checkpoint as C

OPTS = {"epochs": 3, "lr": 0.1, "seed": 5, "progress": False}


@pytest.fixture(scope="module")
def data(digits):
    x, y = digits.train.tensors
    keep = y < 5
    return TensorDataset(x[keep][:64], y[keep][:64])


def loader(data) -> DataLoader:
    return DataLoader(data, batch_size=32, shuffle=True)


def make_bnn():
    torch.manual_seed(0)
    base = DigitsCNN(num_classes=5, width=4).eval()
    torch.manual_seed(1)
    return bayesify(base, "ibnn", components=2, samples=1)


def posterior(bnn) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}


@pytest.fixture(scope="module")
def full_run(data, tmp_path_factory):
    """The uninterrupted run and its checkpoints (kept: all)."""
    directory = tmp_path_factory.mktemp("ckpts")
    bnn = make_bnn()
    fit(bnn, loader(data), checkpoint_dir=directory, checkpoint_every_steps=1,
        keep_checkpoints=0, **OPTS)
    return posterior(bnn), directory


def copy_checkpoints(directory, target, upto: int):
    """The first ``upto`` checkpoints of ``directory`` in ``target`` (a run killed there)."""
    target.mkdir(exist_ok=True)
    files = C.list_checkpoints(directory)[:upto]
    for path in files:
        (target / path.name).write_bytes(path.read_bytes())
    return [target / p.name for p in files]


def flip_inside_tensor(path, tensor: torch.Tensor) -> None:
    """Flip 8 bits of ``tensor``'s stored bytes inside the checkpoint file ``path``."""
    raw = bytearray(path.read_bytes())
    needle = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = raw.find(needle)
    assert at >= 0 and raw.find(needle, at + 1) < 0, "tensor bytes not found once in the file"
    raw[at + len(needle) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_flipped_posterior_bits_are_detected_and_resume_falls_back(data, tmp_path, full_run):
    expected, directory = full_run
    files = copy_checkpoints(directory, tmp_path / "run", upto=4)  # killed after step 4
    newest = files[-1]
    name, tensor = min(torch.load(newest, weights_only=True)["posterior"].items())
    flip_inside_tensor(newest, tensor)
    raw = torch.load(newest, weights_only=True)  # torch itself loads the damaged file silently
    assert not torch.equal(raw["posterior"][name], tensor)

    with pytest.raises(BayesifyError, match="does not match its checksum"):
        C.load_checkpoint(newest)
    bnn = make_bnn()
    with pytest.raises(BayesifyError, match="checksum"):  # an explicit file: refused
        fit(bnn, loader(data), resume=newest, checkpoint_every_steps=1, keep_checkpoints=0,
            **OPTS)
    with pytest.warns(UserWarning, match=rf"resuming from {files[-2].name}.*skipped 1 damaged"):
        fit(bnn, loader(data), resume=tmp_path / "run", checkpoint_every_steps=1,
            keep_checkpoints=0, **OPTS)
    got = posterior(bnn)  # resumed from step 3: still the uninterrupted result, exactly
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(data, tmp_path, full_run):
    _, directory = full_run
    for path in copy_checkpoints(directory, tmp_path / "run", upto=2):
        path.write_bytes(path.read_bytes()[:-300])
    with pytest.raises(BayesifyError, match="no checkpoint in the directory passes"):
        fit(make_bnn(), loader(data), resume=tmp_path / "run", **OPTS)


def _reseal(path, payload) -> None:
    payload = dict(payload)
    payload["checksum"] = C.content_checksum(payload)
    torch.save(payload, path)


def test_a_corrupt_rng_record_is_a_clear_error(data, tmp_path, full_run):
    _, directory = full_run
    (path,) = copy_checkpoints(directory, tmp_path, upto=1)
    payload = torch.load(path, weights_only=True)
    state = payload["rng"][0]["cpu"].clone()
    state[8:12] = 255  # mt19937 'left' counter out of range: torch says "Invalid mt19937 state"
    payload["rng"] = [{**payload["rng"][0], "cpu": state}]
    _reseal(path, payload)  # even with a matching checksum (a bug, not bit rot)
    bnn = make_bnn()
    before = posterior(bnn)
    with pytest.raises(BayesifyError, match=r"RNG record 'cpu' of rank 0 is corrupt"):
        fit(bnn, loader(data), resume=path, **OPTS)
    assert all(torch.equal(before[k], v) for k, v in posterior(bnn).items())  # untouched


def test_old_unchecksummed_and_foreign_versions_are_refused(tmp_path, full_run):
    _, directory = full_run
    (path,) = copy_checkpoints(directory, tmp_path, upto=1)
    payload = torch.load(path, weights_only=True)
    payload["version"] = 1
    payload.pop("checksum")
    torch.save(payload, path)
    with pytest.raises(BayesifyError, match="without a content checksum"):
        C.load_checkpoint(path)
    payload["version"] = True  # a bool is not a version
    torch.save(payload, path)
    with pytest.raises(BayesifyError, match="format version True"):
        C.load_checkpoint(path)


def test_a_nonfinite_state_is_never_written(data, tmp_path, caplog):
    class PoisonMomentum:
        """After step 1, a NaN momentum: step 2's loss is finite, its update is not."""

        def on_step_end(self, state, terms):
            if state.global_step == 1:
                buf = next(iter(state.optimizer.state.values()))["momentum_buffer"]
                buf.fill_(float("nan"))

    bnn = make_bnn()
    # the step guard sees the non-finite update first: it undoes it, clears the optimiser
    # state (the NaN momentum with it), halves the learning rate and goes on
    with caplog.at_level("WARNING", logger="bayesify.train.guard"):
        fit(bnn, loader(data), checkpoint_dir=tmp_path, checkpoint_every_steps=1,
            keep_checkpoints=0, callbacks=[PoisonMomentum()], **OPTS)
    said = [r.getMessage() for r in caplog.records if r.name == "bayesify.train.guard"]
    assert len(said) == 1 and "made the posterior non-finite" in said[0], said
    assert all(torch.isfinite(p).all() for p in bnn.posterior_parameters())
    files = C.list_checkpoints(tmp_path)
    assert files[0].name == "epoch0000-step00000001.ckpt" and len(files) > 1
    for path in files:  # everything on disk is finite and verifies
        assert not C.nonfinite_tensors(C.load_checkpoint(path))


def test_stale_temp_files_of_dead_writers_are_removed(data, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".epoch0001-step00000002.ckpt.tmp-{dead_pid}"
    live = tmp_path / f".epoch0001-step00000002.ckpt.tmp-{os.getppid()}"  # a running process
    other = tmp_path / ".notes.tmp-1"  # not a checkpoint temp file: never touched
    for path in (stale, live, other):
        path.write_bytes(b"partial")
    fit(make_bnn(), loader(data), checkpoint_dir=tmp_path, **{**OPTS, "epochs": 1})
    assert not stale.exists() and live.exists() and other.exists()
    assert C.remove_stale_temp_files(tmp_path) == []


def test_pickle_refusal_keeps_torchs_whole_warning(tmp_path):
    path = tmp_path / "epoch0001-step00000002.ckpt"
    torch.save({"format": "bayesify-checkpoint", "hook": warnings.WarningMessage}, path)
    with pytest.raises(BayesifyError) as info:
        C.load_checkpoint(path)
    message = str(info.value)
    assert "never unpickles" in message
    assert "arbitrary code execution" in message  # torch's warning, not cut at 200 characters
    assert "WarningMessage" in message  # and the global it refused


def test_the_writer_refuses_a_nonfinite_state(data, tmp_path):
    """Second line of defence: a state made non-finite outside the optimiser step (here a
    callback) is never written; the newest finite checkpoint stays the newest."""

    class PoisonPosterior:
        def on_step_end(self, state, terms):
            if state.global_step == 2:
                with torch.no_grad():
                    next(iter(state.bnn.posterior_parameters())).fill_(float("nan"))

    with pytest.raises(NonFiniteLossError, match=r"refusing to write checkpoint .*epoch0001-step"
                       r"00000002.*NaN/inf in \['posterior\..*epoch0000-step00000001.ckpt"):
        fit(make_bnn(), loader(data), checkpoint_dir=tmp_path, checkpoint_every_steps=1,
            keep_checkpoints=0, callbacks=[PoisonPosterior()], **OPTS)
    assert [p.name for p in C.list_checkpoints(tmp_path)] == ["epoch0000-step00000001.ckpt"]
