"""Resume checks what the schedule depends on; runs sharing a directory keep their files.

A checkpoint records the run's length (``epochs``, batches per epoch) besides the fit
options (schedules, KL annealing, accumulation, batch size) and the family config
(snapshot count, SWAG settings). Resuming with any of them changed is refused with
both values named, before the model changes; resuming with the same ones reproduces
the uninterrupted run exactly, for snapshot ensembles and SWAG too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit
from bayesify.data.models import DigitsCNN
from bayesify.train import checkpoint as C

FAMILIES = {
    "ibnn-cosine": ("ibnn", {"components": 2}, {"lr": 0.05, "lr_schedule": "cosine"}),
    "snapshot-ensemble": ("ensemble", {"components": 2, "snapshot": True}, {}),
    "swag": ("swag", {"max_rank": 3, "snapshot_every_steps": 1, "scale_method": "fixed"}, {}),
}


class Kill(Exception):
    pass


class KillAfterEpoch:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_epoch_end(self, state, record) -> None:
        if state.epoch == self.epoch:
            raise Kill


@pytest.fixture(scope="module")
def data(digits):
    x, y = digits.train.tensors
    keep = y < 5
    return TensorDataset(x[keep][:64], y[keep][:64])


def loader(data, batch_size: int = 32) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=True)


def make(method: str, options: dict):
    torch.manual_seed(0)
    base = DigitsCNN(num_classes=5, width=4).eval()
    torch.manual_seed(1)
    return bayesify(base, method, **options)


def state(bnn) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in bnn.state_dict().items()}


def equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(family: str, data, **kwargs):
    method, options, fit_options = FAMILIES[family]
    bnn = make(method, options)
    opts = {"epochs": 2, "seed": 4, "progress": False, **fit_options, **kwargs}
    return bnn, fit(bnn, loader(data, opts.pop("batch_size", 32)), **opts)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_resume_after_a_kill_equals_the_uninterrupted_run(data, tmp_path, family):
    full, _ = run(family, data, epochs=3)
    with pytest.raises(Kill):
        run(family, data, epochs=3, checkpoint_dir=tmp_path, callbacks=[KillAfterEpoch(1)])
    resumed, result = run(family, data, epochs=3, resume=tmp_path, checkpoint_dir=tmp_path)
    assert equal(state(resumed), state(full))
    assert [r["epoch"] for r in result.history] == [1, 2, 3]
    if family == "snapshot-ensemble":  # member 1 was trained, not a copy of member 0
        layer = resumed.bayesian_layers()["fc"]
        weights = next(p for n, p in layer.named_parameters() if "base_layer" not in n)
        assert not torch.equal(weights[0], weights[1])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("epochs", [1, 6])
def test_resume_with_another_number_of_epochs_is_refused(data, tmp_path, family, epochs):
    run(family, data, epochs=3, checkpoint_dir=tmp_path)
    bnn = make(*FAMILIES[family][:2])
    before = state(bnn)
    _, _options, fit_options = FAMILIES[family]
    with pytest.raises(BayesifyError, match=f"epochs: checkpoint 3, now {epochs}"):
        fit(bnn, loader(data), epochs=epochs, seed=4, progress=False, resume=tmp_path,
            **fit_options)
    assert equal(state(bnn), before)  # refused before anything changed


@pytest.mark.parametrize(("change", "named"), [
    ({"lr_schedule": "linear:0:2:0.1"}, "lr_schedule"),
    ({"kl_anneal_epochs": 1.0}, "kl_anneal_epochs"),
    ({"grad_accum_steps": 2}, "grad_accum_steps"),
    ({"beta": 0.5}, "beta"),
    ({"base_lr": 1e-3}, "base_lr"),
    ({"batch_size": 16}, "global_batch_size"),
])
def test_resume_with_another_schedule_field_is_refused(data, tmp_path, change, named):
    run("ibnn-cosine", data, checkpoint_dir=tmp_path)
    with pytest.raises(BayesifyError, match=rf"{named}: checkpoint .*, now "):
        run("ibnn-cosine", data, resume=tmp_path, **change)


def test_resume_with_another_data_size_is_refused(data, tmp_path):
    run("ibnn-cosine", data, checkpoint_dir=tmp_path)
    x, y = data.tensors
    bigger = TensorDataset(torch.cat([x, x]), torch.cat([y, y]))
    with pytest.raises(BayesifyError, match="n_train: checkpoint 64, now 128"):
        run("ibnn-cosine", bigger, resume=tmp_path)


def test_snapshot_count_is_part_of_the_identity(data, tmp_path):
    run("snapshot-ensemble", data, checkpoint_dir=tmp_path)
    bnn = make("ensemble", {"components": 3, "snapshot": True})
    with pytest.raises(BayesifyError, match="components"):
        fit(bnn, loader(data), epochs=2, seed=4, progress=False, resume=tmp_path)


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in C.list_checkpoints(directory)}


def test_runs_sharing_a_checkpoint_dir_never_prune_each_other(data, tmp_path):
    run("ibnn-cosine", data, epochs=3, checkpoint_dir=tmp_path, keep_checkpoints=2)
    first = contents(tmp_path)
    assert sorted(first) == ["epoch0002-step00000004.ckpt", "epoch0003-step00000006.ckpt"]
    # a new, shorter run in the same directory keeps its own checkpoint ...
    run("ibnn-cosine", data, epochs=1, checkpoint_dir=tmp_path, keep_checkpoints=1)
    second = {k: v for k, v in contents(tmp_path).items() if k not in first}
    assert len(second) == 1 and next(iter(second)).startswith("epoch0001-step00000002-")
    # ... a third one prunes only its own files ...
    run("ibnn-cosine", data, epochs=3, checkpoint_dir=tmp_path, keep_checkpoints=1)
    now = contents(tmp_path)
    assert {k: now[k] for k in first} == first and {k: now[k] for k in second} == second
    third = sorted(set(now) - set(first) - set(second))
    assert len(third) == 1 and third[0].startswith("epoch0003-step00000006-")
    # ... and resuming from the directory continues the most recent run (finished: no step)
    _bnn, result = run("ibnn-cosine", data, epochs=3, resume=tmp_path)
    assert len(result.history) == 3
    assert C.load_checkpoint(tmp_path / third[0])["meta"]["run_id"] == third[0][-13:-5]


def test_a_resumed_run_keeps_its_id_and_prunes_only_its_files(data, tmp_path):
    run("ibnn-cosine", data, epochs=3, checkpoint_dir=tmp_path, keep_checkpoints=0)
    first = contents(tmp_path)
    with pytest.raises(Kill):
        run("ibnn-cosine", data, epochs=3, checkpoint_dir=tmp_path, keep_checkpoints=0,
            callbacks=[KillAfterEpoch(1)])
    mine = sorted(set(contents(tmp_path)) - set(first))
    assert len(mine) == 1
    run("ibnn-cosine", data, epochs=3, checkpoint_dir=tmp_path, keep_checkpoints=1,
        resume=tmp_path / mine[0])
    now = contents(tmp_path)
    assert {k: now[k] for k in first} == first
    rest = sorted(set(now) - set(first))
    assert len(rest) == 1 and rest[0].startswith("epoch0003") and rest[0][-13:] == mine[0][-13:]


def test_a_symlink_at_the_old_temporary_name_is_not_written_through(data, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    name = C.checkpoint_name(1, 2)
    (directory / f".{name}.tmp-{os.getpid()}").symlink_to(victim)
    run("ibnn-cosine", data, epochs=1, checkpoint_dir=directory)
    assert victim.read_text() == "precious"
    assert C.load_checkpoint(directory / name)["meta"]["epoch"] == 1


def test_a_kill_at_every_point_of_a_checkpoint_write(tmp_path):
    from tests.test_failure_save import run_script

    result = run_script("ckpt-points", tmp_path / "ckpt")
    assert result["failures"] == [] and result["loaded"] == result["tries"] >= 10
    assert result["a"] > 0 and result["b"] > 0


def test_runs_starting_together_in_an_empty_directory_get_their_own_files(data, tmp_path):
    import threading

    barrier, errors = threading.Barrier(3), []

    def one_run(index: int) -> None:
        try:
            barrier.wait()
            run("ibnn-cosine", data, epochs=2, checkpoint_dir=tmp_path, keep_checkpoints=1,
                seed=10 + index)
        except Exception as err:  # noqa: BLE001 - collected
            errors.append(repr(err))

    threads = [threading.Thread(target=one_run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    files = C.list_checkpoints(tmp_path)
    ids = {C.load_checkpoint(p)["meta"]["run_id"] for p in files}
    assert len(files) == 3 and len(ids) == 3  # one newest file per run, none overwritten
    assert all(p.name.startswith("epoch0002-step00000004") for p in files)
