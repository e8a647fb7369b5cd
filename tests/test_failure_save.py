"""A posterior is never lost: every failure or kill during a save leaves a loadable directory.

The kill tests run ``tests/failure_scripts/save_kill.py`` (one subprocess that forks a
saver per try): a kill before or after every file-system call of a re-save and
halfway through every file write, SIGKILL at random times, concurrent savers.
In-process tests inject I/O errors between the two files, plant symlinks at
temporary and final names, feed configs JSON cannot hold, and save after a dtype
change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bayesify import BayesifyError, bayesify, load_posterior
from bayesify import persistence as P
from bayesify import posterior_commit as PC

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "failure_scripts" / "save_kill.py"


def run_script(mode: str, directory: Path, count: int = 5, timeout: int = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    out = subprocess.run([sys.executable, str(SCRIPT), mode, str(directory), str(count)],
                         capture_output=True, text=True, timeout=timeout, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _net(bn: bool) -> nn.Module:
    layers = [nn.Linear(6, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.ReLU(), nn.Linear(16, 3)]
    return nn.Sequential(*layers).eval()


torch.manual_seed(0)
_WEIGHTS = {bn: _net(bn).state_dict() for bn in (False, True)}  # fixed: threads share no RNG


def base() -> nn.Module:
    net = _net(False)
    net.load_state_dict(_WEIGHTS[False])
    return net


def bn_base() -> nn.Module:
    net = _net(True)
    net.load_state_dict(_WEIGHTS[True])
    return net


def posterior(seed: int, make=base, **options):
    bnn = bayesify(make(), "ibnn", **{"components": 2, **options})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bnn.posterior_parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return bnn


def same(a, b) -> bool:
    ta, tb = a.posterior_tensors(), b.posterior_tensors()
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# -- kills --------------------------------------------------------------------------------
def test_a_kill_at_every_point_of_a_resave_leaves_the_old_or_the_new_posterior(tmp_path):
    result = run_script("points", tmp_path / "post")
    assert result["failures"] == [] and result["loaded"] == result["tries"]
    assert result["tries"] >= 20  # before/after every primitive and mid-write of both files
    assert result["a"] > 0 and result["b"] > 0  # kills before and after the commit


def test_sigkill_at_random_times_during_resaves(tmp_path):
    result = run_script("sigkill", tmp_path / "post", count=6)
    assert result["failures"] == [] and result["loaded"] == 6


@pytest.mark.slow
def test_sigkill_at_random_times_many(tmp_path):
    result = run_script("sigkill", tmp_path / "post", count=100)
    assert result["failures"] == [] and result["loaded"] == 100


def test_concurrent_saving_processes_never_corrupt_the_directory(tmp_path):
    result = run_script("concurrent", tmp_path / "post", count=4)
    assert result["failures"] == [] and result["loaded"] == result["tries"] == 3


def test_concurrent_saving_and_loading_threads(tmp_path):
    directory = tmp_path / "post"
    models = [posterior(i) for i in range(3)]
    models[0].save_posterior(directory)
    errors: list[str] = []
    loaded: list[int] = []

    def saver(model):
        try:
            for _ in range(4):
                model.save_posterior(directory)
        except Exception as err:  # noqa: BLE001 - collected
            errors.append(repr(err))

    def loader():
        try:
            for _ in range(6):
                bnn = load_posterior(base(), directory)
                loaded.append(next(i for i, m in enumerate(models) if same(bnn, m)))
        except Exception as err:  # noqa: BLE001 - collected
            errors.append(repr(err))

    threads = [threading.Thread(target=saver, args=(m,)) for m in models]
    threads += [threading.Thread(target=loader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(loaded) == 12
    assert sorted(p.name for p in directory.iterdir()) == [P.MANIFEST_FILE, P.TENSOR_FILE]


# -- injected errors ----------------------------------------------------------------------
@pytest.mark.parametrize("failing_call", [1, 2])
def test_io_error_between_the_two_files(tmp_path, monkeypatch, failing_call):
    """1: the manifest rename fails (the old posterior stays); 2: the tensor rename after
    the commit fails (the new one loads from its pending file, the next save settles it)."""
    directory = tmp_path / "post"
    old, new = posterior(1), posterior(2)
    old.save_posterior(directory)
    real, calls = PC.replace, []

    def flaky(source, target):
        calls.append(target)
        if len(calls) == failing_call:
            raise OSError(28, "No space left on device")
        return real(source, target)

    monkeypatch.setattr(PC, "replace", flaky)
    with pytest.raises(OSError, match="No space"):
        new.save_posterior(directory)
    monkeypatch.setattr(PC, "replace", real)
    assert same(load_posterior(base(), directory), old if failing_call == 1 else new)
    if failing_call == 1:  # nothing of the failed save is left behind
        assert sorted(p.name for p in directory.iterdir()) == [P.MANIFEST_FILE, P.TENSOR_FILE]
    posterior(3).save_posterior(directory)
    assert sorted(p.name for p in directory.iterdir()) == [P.MANIFEST_FILE, P.TENSOR_FILE]


def test_failed_temp_write_leaves_the_directory_unchanged(tmp_path, monkeypatch):
    directory = tmp_path / "post"
    old = posterior(1)
    old.save_posterior(directory)
    before = snapshot(directory)
    real = PC.write_temp

    def failing(directory, data, **kwargs):
        if kwargs.get("suffix") == ".json.tmp":
            raise OSError(5, "Input/output error")
        return real(directory, data, **kwargs)

    monkeypatch.setattr(PC, "write_temp", failing)
    with pytest.raises(OSError):
        posterior(2).save_posterior(directory)
    assert snapshot(directory) == before


def test_a_config_json_cannot_hold_fails_before_any_write(tmp_path):
    directory = tmp_path / "post"
    posterior(1).save_posterior(directory)
    before = snapshot(directory)
    bad = posterior(2)
    object.__setattr__(bad.posterior_config, "targets", {"a set", "is not JSON"})
    with pytest.raises(BayesifyError, match="json cannot store"):
        bad.save_posterior(directory)
    assert snapshot(directory) == before


def test_numpy_scalars_in_a_config_are_normalised(tmp_path):
    bnn = posterior(1, prior_std=np.float32(0.25), components=np.int64(2))
    bnn.save_posterior(tmp_path)
    manifest = json.loads((tmp_path / P.MANIFEST_FILE).read_text())
    assert manifest["config"]["prior_std"] == pytest.approx(0.25)
    assert type(manifest["config"]["components"]) is int
    assert same(load_posterior(base(), tmp_path), bnn)
    object.__setattr__(bnn.posterior_config, "prior_std", np.float32(0.5))  # past the config's checks
    bnn.save_posterior(tmp_path)
    assert json.loads((tmp_path / P.MANIFEST_FILE).read_text())["config"]["prior_std"] == 0.5


def test_non_finite_tensors_are_never_written(tmp_path):
    directory = tmp_path / "post"
    good = posterior(1, make=bn_base)
    good.save_posterior(directory)
    before = snapshot(directory)
    for poison in ("posterior", "buffer"):
        bad = posterior(2, make=bn_base)
        with torch.no_grad():
            if poison == "posterior":
                bad.posterior_parameters()[0][0] = float("nan")
            else:  # a BatchNorm statistic (a changed base buffer)
                bad.model[1].running_var[3] = float("inf")
        with pytest.raises(BayesifyError, match="NaN/inf"):
            bad.save_posterior(directory)
        assert snapshot(directory) == before


# -- names in the directory ----------------------------------------------------------------
@pytest.mark.parametrize("name", [".bayesify.json.tmp", ".posterior.safetensors.tmp",
                                  P.MANIFEST_FILE, P.TENSOR_FILE])
def test_symlinks_in_the_directory_are_never_written_through(tmp_path, name):
    directory, outside = tmp_path / "post", tmp_path / "victim.txt"
    outside.write_text("precious")
    posterior(1).save_posterior(directory)
    (directory / name).unlink(missing_ok=True)
    (directory / name).symlink_to(outside)
    bnn = posterior(2)
    bnn.save_posterior(directory)
    assert outside.read_text() == "precious"
    assert same(load_posterior(base(), directory), bnn)


def test_a_save_into_a_file_path_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(BayesifyError, match="not a directory"):
        posterior(1).save_posterior(path)


# -- dtypes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_the_dtype_of_a_saved_model_is_restored(tmp_path, dtype):
    bnn = posterior(1, make=bn_base).to(dtype)
    bnn.save_posterior(tmp_path)
    loaded = load_posterior(bn_base(), tmp_path)
    for (name, a), (_, b) in zip(bnn.state_dict().items(), loaded.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    x = torch.randn(4, 6, dtype=dtype)
    expected = bnn.predictor(seed=3)(x).probs
    assert torch.equal(loaded.predictor(seed=3)(x).probs, expected)


def test_a_saved_half_model_also_loads_onto_the_half_base(tmp_path):
    bnn = posterior(1, make=bn_base).half()
    bnn.save_posterior(tmp_path)
    loaded = load_posterior(bn_base().half(), tmp_path)
    x = torch.randn(4, 6, dtype=torch.float16)
    assert torch.equal(loaded.predictor(seed=3)(x).probs, bnn.predictor(seed=3)(x).probs)


def test_a_mixed_dtype_model_is_restored(tmp_path):
    bnn = posterior(1, make=bn_base)
    bnn.model[3].to(torch.float64)  # only the head (wrapped layer and its posterior)
    bnn.save_posterior(tmp_path)
    loaded = load_posterior(bn_base(), tmp_path)
    assert {n: t.dtype for n, t in loaded.state_dict().items()} == \
        {n: t.dtype for n, t in bnn.state_dict().items()}


# -- the CLI's staged run directory -------------------------------------------------------------
def test_a_staged_run_moves_its_posterior_in_one_commit(tmp_path, monkeypatch):
    from bayesify.cli_inputs import StagedOutput

    out = tmp_path / "run"
    posterior(1).save_posterior(out)
    (out / "calibration.json").write_text("{}")
    new = posterior(2)
    real, order = PC.replace, []
    monkeypatch.setattr(PC, "replace", lambda s, t: (order.append(Path(t).name), real(s, t)))
    with StagedOutput(out) as stage:
        new.save_posterior(stage)
        (stage / "run.json").write_text("{}")
    assert order[-2:] == [P.MANIFEST_FILE, P.TENSOR_FILE]  # the manifest commits first
    assert same(load_posterior(base(), out), new)
    assert sorted(p.name for p in out.iterdir()) == [
        P.MANIFEST_FILE, "calibration.json", P.TENSOR_FILE, "run.json"]
