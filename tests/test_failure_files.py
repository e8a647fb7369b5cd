"""Files under faults and hostile neighbours (issue 35, items 1–6, 13, 14).

- an export's program, ``FILE.json`` and ``FILE.sha256`` commit as one: a kill before
  or after every file-system call (simulated by a snapshot of the directory at that
  moment) and ENOSPC at every write leave the old export or the new one, whole;
- symlinks planted at the old fixed temporary name and at the final names are never
  written through; two processes exporting to one path both succeed;
- ``save_posterior`` refuses a directory whose ``bayesify.json`` is someone else's and
  deletes only temporary files carrying its own marker; the CLI never deletes a
  user's ``OUT.incomplete``;
- sizes are checked before a tensor file is read (a 64 GiB sparse file);
- a program without bayesify metadata, outputs of other shapes, a pickle named
  ``.onnx`` and NaN inputs are refused by ``run_exported``;
- the base fingerprint sees GELU vs ReLU; an HMAC key detects a resealed manifest.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from bayesify import BayesifyError, bayesify, load_posterior
from bayesify import persistence as P
from bayesify.predict import export as E
from bayesify.predict.export import load_exported, run_exported
from bayesify.predict.export_trust import read_verified, sha256_of, write_sha256

X = torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
FILES = ["m.pt2", "m.pt2.json", "m.pt2.sha256"]


def net(act: type[nn.Module] = nn.ReLU) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), act(), nn.Linear(8, 3)).eval()


def predictor(seed: int):
    bnn = bayesify(net(), "ibnn", components=2)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bnn.posterior_parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    return bnn.predictor(samples_per_component=2)


def regular_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Old and new exports of two posteriors: their bytes and metadata text."""
    out = tmp_path_factory.mktemp("exports")
    versions = {}
    for name, seed in (("old", 1), ("new", 2)):
        pred = predictor(seed)
        pred.export(out / name / "m.pt2", X, verify=name == "old")
        versions[name] = {"predictor": pred,
                          **{f: (out / name / f).read_bytes() for f in FILES}}
    return versions


def install_old(exports, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        (directory / f).write_bytes(exports["old"][f])


def which_export(exports, directory: Path) -> str:
    """'old' / 'new' when the export in ``directory`` verifies as one of them, whole
    (program and FILE.json); the error otherwise."""
    try:
        data = read_verified(directory / "m.pt2")
    except BayesifyError as err:
        return f"error: {err}"
    for name in ("old", "new"):
        if data == exports[name]["m.pt2"]:
            beside = (directory / "m.pt2.json").read_bytes()
            return name if beside == exports[name]["m.pt2.json"] else f"{name} with stale json"
    return "error: neither export"


class Faults:
    """Counts file-system writes (open for writing, write, fsync, rename, write_bytes /
    write_text) and calls ``hook(k)`` before each."""

    def __init__(self, monkeypatch, hook) -> None:
        self.count, self.hook, self.mp = 0, hook, monkeypatch
        for name in ("replace", "rename", "fsync"):
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name)))
        real_open, real_fdopen = os.open, os.fdopen

        def opened(path, flags, *args, **kwargs):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                self._event()
            return real_open(path, flags, *args, **kwargs)

        def fdopen(*args, **kwargs):
            fh = real_fdopen(*args, **kwargs)
            raw = fh.write
            fh.write = lambda data: (self._event(), raw(data))[1]
            return fh

        monkeypatch.setattr(os, "open", opened)
        monkeypatch.setattr(os, "fdopen", fdopen)
        for name in ("write_bytes", "write_text"):
            monkeypatch.setattr(Path, name, self._wrap(getattr(Path, name)))

    def _event(self) -> None:
        self.count += 1
        self.hook(self.count)

    def _wrap(self, fn):
        def wrapped(*args, **kwargs):
            self._event()
            return fn(*args, **kwargs)

        return wrapped


def cached_program(monkeypatch) -> None:
    """Trace once per test: the file writes, not torch.export, are under test."""
    real, cache = E.export_program, {}

    def export_program(module, example, *, method="model"):
        if "program" not in cache:
            cache["program"] = real(module, example, method=method)
        return cache["program"]

    monkeypatch.setattr(E, "export_program", export_program)


# -- 1: one commit ------------------------------------------------------------------------
def test_a_kill_at_every_point_of_a_re_export_leaves_the_old_or_the_new_export(
        exports, tmp_path, monkeypatch):
    directory = tmp_path / "e"
    install_old(exports, directory)
    states: dict[tuple, dict[str, bytes]] = {}

    def snapshot(_k: int) -> None:  # the directory as a kill at this moment would leave it
        files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
        states.setdefault(tuple(sorted((n, sha256_of(b)) for n, b in files.items())), files)

    with monkeypatch.context() as mp:
        Faults(mp, snapshot)
        exports["new"]["predictor"].export(directory / "m.pt2", X, verify=False)
    snapshot(0)
    assert len(states) >= 4
    outcomes = []
    for i, files in enumerate(states.values()):
        copy = tmp_path / f"kill{i}"
        copy.mkdir()
        for name, data in files.items():
            (copy / name).write_bytes(data)
        outcomes.append(which_export(exports, copy))
    assert set(outcomes) == {"old", "new"}, outcomes
    assert which_export(exports, directory) == "new" and regular_files(directory) == FILES


def test_enospc_at_every_write_of_a_re_export_leaves_the_old_or_the_new_export(
        exports, tmp_path, monkeypatch):
    cached_program(monkeypatch)
    directory, outcomes = tmp_path / "e", []
    for k in range(1, 60):
        shutil.rmtree(directory, ignore_errors=True)
        install_old(exports, directory)

        def fail(count: int, k=k) -> None:
            if count == k:
                raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as mp:
            faults = Faults(mp, fail)
            try:
                exports["new"]["predictor"].export(directory / "m.pt2", X, verify=False)
            except OSError as err:
                assert err.errno == errno.ENOSPC
        outcomes.append(which_export(exports, directory))
        assert regular_files(directory) == FILES, (k, regular_files(directory))
        if faults.count < k:  # the export finished without reaching the k-th write
            break
    assert outcomes[-1] == "new" and set(outcomes) <= {"old", "new"}, outcomes
    # failures before the commit leave the old export; after it (the renames), the new one
    assert outcomes.count("old") >= 9 and outcomes[:-1].count("new") >= 2, outcomes
    assert torch.equal(run_exported(directory / "m.pt2", X).probs,
                       run_exported(directory / "m.pt2", X, check_sha256=True).probs)


# -- 2: names -------------------------------------------------------------------------------
def test_symlinks_are_never_written_through_by_an_export(exports, tmp_path, monkeypatch):
    cached_program(monkeypatch)
    directory, victim = tmp_path / "e", tmp_path / "victim.txt"
    install_old(exports, directory)
    victim.write_text("precious")
    for name in (".m.tmp.pt2", "m.pt2", "m.pt2.json", "m.pt2.sha256"):
        (directory / name).unlink(missing_ok=True)
        (directory / name).symlink_to(victim)
    exports["new"]["predictor"].export(directory / "m.pt2", X, verify=False)
    assert victim.read_text() == "precious"
    assert [n for n in FILES if (directory / n).is_symlink()] == []
    assert which_export(exports, directory) == "new"


def _export(path: str, seed: int, barrier) -> None:
    torch.set_num_threads(1)
    pred = predictor(seed)
    barrier.wait()
    pred.export(path, X)


def test_two_processes_exporting_to_one_path_both_succeed(exports, tmp_path):
    path = tmp_path / "e" / "m.pt2"
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    children = [context.Process(target=_export, args=(str(path), seed, barrier))
                for seed in (1, 2)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [c.exitcode for c in children] == [0, 0]
    assert which_export(exports, path.parent) in ("old", "new")
    assert regular_files(path.parent) == FILES


# -- 3: foreign files -------------------------------------------------------------------------
def _posterior(seed: int, act=nn.ReLU):
    bnn = bayesify(net(act), "ibnn", components=2)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bnn.posterior_parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    return bnn


@pytest.mark.parametrize("content", ['{"name": "my-package", "version": "1.0"}', "not json"])
def test_a_foreign_manifest_is_never_overwritten(tmp_path, content):
    (tmp_path / P.MANIFEST_FILE).write_text(content)
    with pytest.raises(BayesifyError, match="not a bayesify posterior manifest"):
        _posterior(1).save_posterior(tmp_path)
    assert (tmp_path / P.MANIFEST_FILE).read_text() == content
    assert regular_files(tmp_path) == [P.MANIFEST_FILE]


def test_a_save_deletes_only_its_own_temporary_files(tmp_path):
    user = [".bayesify-notes.json.tmp", ".posterior-0123456789abcdef-mine.safetensors",
            ".bayesify.json.tmp", ".posterior.safetensors.tmp"]
    _posterior(1).save_posterior(tmp_path)
    for name in user:
        (tmp_path / name).write_text("the user's")
    _posterior(2).save_posterior(tmp_path)
    assert all((tmp_path / name).read_text() == "the user's" for name in user)


def test_the_cli_never_deletes_a_users_incomplete_folder(tmp_path):
    from bayesify.cli_inputs import StagedOutput, check_out

    out = tmp_path / "run"
    mine = tmp_path / "run.incomplete"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(BayesifyError, match="not made by bayesify"):
        check_out(out)
    with pytest.raises(BayesifyError, match="not made by bayesify"), StagedOutput(out):
        pass
    assert (mine / "notes.txt").read_text() == "the user's"
    shutil.rmtree(mine)
    with pytest.raises(RuntimeError), StagedOutput(out) as stage:  # an interrupted run's folder
        (stage / "partial.json").write_text("{}")
        shutil.copytree(stage, tmp_path / "kept")
        raise RuntimeError("killed")
    shutil.copytree(tmp_path / "kept", mine)  # as a kill would have left it
    with StagedOutput(out) as stage:  # bayesify's own: removed and staged afresh
        (stage / "run.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["run.json"] and not mine.exists()


# -- 4: sizes before reading --------------------------------------------------------------------
def test_a_64_gib_sparse_tensor_file_is_refused_before_reading(tmp_path):
    _posterior(1).save_posterior(tmp_path)
    tensor = tmp_path / P.TENSOR_FILE
    sha = json.loads((tmp_path / P.MANIFEST_FILE).read_text())["posterior_sha256"]
    pending = tmp_path / f".posterior-{sha[:16]}-0123456789abcdef01234567.safetensors"
    for sparse in (tensor, pending):
        with sparse.open("wb") as fh:
            fh.truncate(64 << 30)
    start = time.perf_counter()
    with pytest.raises(BayesifyError, match="bytes but bayesify.json records"):
        load_posterior(net(), tmp_path)
    assert time.perf_counter() - start < 5


def test_a_64_gib_sparse_export_is_refused_before_hashing(exports, tmp_path):
    """The committed FILE.json records the program's size: a replaced 64 GiB (sparse) program
    is refused at once, not hashed for minutes."""
    install_old(exports, tmp_path)
    assert json.loads(exports["old"]["m.pt2.json"])["program_bytes"] == len(
        exports["old"]["m.pt2"])
    with (tmp_path / "m.pt2").open("wb") as fh:
        fh.truncate(64 << 30)
    start = time.perf_counter()
    with pytest.raises(BayesifyError, match="bytes but its committed record"):
        run_exported(tmp_path / "m.pt2", X)
    assert time.perf_counter() - start < 5


def test_a_crafted_header_in_an_old_manifest_is_refused_before_reading(tmp_path):
    """No ``posterior_bytes`` (written before it existed): the header's own size and the
    dry run's shapes are checked before the data is read."""
    _posterior(1).save_posterior(tmp_path)
    tensor = tmp_path / P.TENSOR_FILE
    head = tensor.read_bytes()
    length = int.from_bytes(head[:8], "little")
    header = json.loads(head[8:8 + length])
    name = next(k for k in header if k != "__metadata__" and k.endswith("mean"))
    size = 4 * (1 << 34)  # a 64 GiB tensor claimed
    header[name] = {"dtype": "F32", "shape": [1 << 34], "data_offsets": [0, size]}
    text = json.dumps(header).encode()
    with tensor.open("wb") as fh:
        fh.write(len(text).to_bytes(8, "little") + text)
        fh.truncate(8 + len(text) + size)
    manifest = json.loads((tmp_path / P.MANIFEST_FILE).read_text())
    manifest.pop("posterior_bytes", None)
    manifest["checksum"] = P._manifest_checksum(manifest)
    (tmp_path / P.MANIFEST_FILE).write_text(json.dumps(manifest))
    start = time.perf_counter()
    with pytest.raises(BayesifyError, match="expects"):
        load_posterior(net(), tmp_path)
    assert time.perf_counter() - start < 5


# -- 5, 6: what run_exported runs ------------------------------------------------------------
class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).softmax(-1), self.fc(x).sum(-1)


@pytest.mark.parametrize("metadata", [False, True])
def test_a_program_that_is_not_a_bayesify_export_is_refused(exports, tmp_path, metadata):
    """A plain ``torch.export.save``; with a copied bayesify record (3 classes) its
    [B, 4] outputs do not have the recorded shapes."""
    path = tmp_path / "plain.pt2"
    program = torch.export.export(Plain().eval(), (X,),
                                  dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    extra = {"bayesify.json": exports["old"]["m.pt2.json"].decode()} if metadata else {}
    torch.export.save(program, str(path), extra_files=extra)
    write_sha256(path, sha256_of(path.read_bytes()))
    match = "returned outputs of shapes" if metadata else "not a bayesify export"
    with pytest.raises(BayesifyError, match=match):
        run_exported(path, X)


def test_a_pickle_named_onnx_says_what_it_is(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    write_sha256(path, sha256_of(path.read_bytes()))
    with pytest.raises(BayesifyError, match="not an ONNX model: it is a Python pickle"):
        run_exported(path, X)


def test_the_exported_predictor_refuses_nan_like_the_in_process_one(exports, tmp_path):
    install_old(exports, tmp_path)
    bad = X.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(BayesifyError, match="NaN"):
        exports["old"]["predictor"](bad)
    exported = load_exported(tmp_path / "m.pt2")
    with pytest.raises(BayesifyError, match="NaN"):
        exported(bad)
    bad[1, 2] = float("inf")
    with pytest.raises(BayesifyError, match="inf"):
        exported(bad)
    exported.nonfinite = "propagate"  # the documented opt-out (load_exported(nonfinite=...))
    out = exported(bad)
    assert torch.isnan(out.probs[1]).all() and torch.isfinite(out.probs[[0, 2]]).all()


def test_the_exported_predictor_takes_dtypes_like_the_in_process_one(exports, tmp_path):
    """Issue 35 item 12 for exports: float64 / float16 inputs computed in the program's
    dtype (float64 failed inside the program before), uint8 images refused with how to
    convert them."""
    install_old(exports, tmp_path)
    exported = load_exported(tmp_path / "m.pt2")
    reference = exported(X)
    torch.testing.assert_close(exported(X.double()).probs, reference.probs, rtol=0, atol=0)
    torch.testing.assert_close(exported(X.half()).probs, reference.probs, rtol=0, atol=1e-3)
    with pytest.raises(BayesifyError, match=r"x.float\(\) / 255"):
        exported((X.abs() * 50).to(torch.uint8))


# -- 13, 14: what a posterior is checked against -------------------------------------------------
def test_the_fingerprint_tells_gelu_from_relu(tmp_path):
    bnn = _posterior(1, act=nn.ReLU)
    bnn.save_posterior(tmp_path)
    gelu = net(nn.GELU)
    assert P.fingerprint(gelu.state_dict()) == P.fingerprint(net(nn.ReLU).state_dict())
    with pytest.raises(BayesifyError, match=r"module '1' is GELU\(approximate='none'\) here "
                                            r"but was ReLU\(\)"):
        load_posterior(gelu, tmp_path)
    loaded = load_posterior(net(nn.ReLU), tmp_path)
    assert torch.equal(loaded.predictor(seed=0)(X).probs, bnn.predictor(seed=0)(X).probs)
    # a manifest written before the architecture was recorded: weights only (documented)
    manifest = json.loads((tmp_path / P.MANIFEST_FILE).read_text())
    for key in ("base_architecture", "base_modules"):
        del manifest[key]
    manifest["checksum"] = P._manifest_checksum(manifest)
    (tmp_path / P.MANIFEST_FILE).write_text(json.dumps(manifest))
    load_posterior(gelu, tmp_path)


def test_an_hmac_key_detects_a_resealed_manifest(tmp_path):
    key = b"a key only the user holds"
    _posterior(1).save_posterior(tmp_path / "signed", key=key)
    _posterior(1).save_posterior(tmp_path / "plain")
    load_posterior(net(), tmp_path / "signed", key=key)
    with pytest.raises(BayesifyError, match="does not verify"):
        load_posterior(net(), tmp_path / "signed", key=b"another key")
    with pytest.raises(BayesifyError, match="not signed"):
        load_posterior(net(), tmp_path / "plain", key=key)
    manifest_path = tmp_path / "signed" / P.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["prior_std"] = manifest["config"].get("prior_std", 0.1) * 3
    manifest["checksum"] = P._manifest_checksum(manifest)  # the checksum is resealed...
    manifest_path.write_text(json.dumps(manifest))
    load_posterior(net(), tmp_path / "signed")  # ...so without a key the edit loads
    with pytest.raises(BayesifyError, match="does not verify"):
        load_posterior(net(), tmp_path / "signed", key=key)
