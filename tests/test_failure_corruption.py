"""Every persisted file type, flipped, truncated and re-sealed: nothing corrupt is
ever loaded and nothing valid is ever refused.

- posterior tensors (``posterior.safetensors``) and manifest (``bayesify.json``);
- training checkpoints (``*.ckpt``).

"Re-sealed" means the attacker (or a buggy tool) also rewrote the checksums, so
integrity checks pass and only validation can catch the lie. A load that
succeeds must give exactly the content on disk; everything else must be a
``BayesifyError`` (never a bare ``KeyError``, ``RecursionError``, ``MemoryError``).
"""

from __future__ import annotations

import json
import random
import resource
import time

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit, load_posterior
from bayesify import persistence as P
from bayesify.data.models import DigitsCNN
from bayesify.train import checkpoint as C

POSITIONS = 24  # sampled byte positions per file (deterministic)


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DigitsCNN(num_classes=5, width=4).eval()


@pytest.fixture()
def saved(tmp_path):
    torch.manual_seed(1)
    bnn = bayesify(base_model(), "ibnn", components=2)
    with torch.no_grad():
        for p in bnn.posterior_parameters():
            p.add_(0.1 * torch.randn_like(p))
    directory = bnn.save_posterior(tmp_path / "post")
    return {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}, directory


def reseal(directory, **fields) -> None:
    manifest = json.loads((directory / P.MANIFEST_FILE).read_text())
    manifest.update(fields)
    manifest["posterior_sha256"] = P._file_sha256(directory / P.TENSOR_FILE)
    manifest["posterior_bytes"] = (directory / P.TENSOR_FILE).stat().st_size
    manifest["checksum"] = P._manifest_checksum(manifest)
    (directory / P.MANIFEST_FILE).write_text(json.dumps(manifest))


def positions(size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted({0, size - 1, *(rng.randrange(size) for _ in range(POSITIONS))})


def loads_exactly_the_file(directory) -> bool:
    """Load; ``True`` when it succeeded with exactly the file's tensors."""
    try:
        bnn = load_posterior(base_model(), directory)
    except BayesifyError:
        return False
    on_disk = load_file(str(directory / P.TENSOR_FILE))
    for name, p in bnn.named_posterior_parameters():
        assert torch.equal(p.detach(), on_disk[name])  # loaded == what the file says
    return True


def test_valid_posteriors_are_never_refused(saved):
    expected, directory = saved
    reseal(directory)  # a no-op re-seal is still the same valid posterior
    assert loads_exactly_the_file(directory)
    bnn = load_posterior(base_model(), directory)
    assert all(torch.equal(p, expected[n]) for n, p in bnn.named_posterior_parameters())


@pytest.mark.parametrize("name", [P.TENSOR_FILE, P.MANIFEST_FILE])
def test_flipped_or_truncated_files_are_refused(saved, name):
    _, directory = saved
    path = directory / name
    original = path.read_bytes()
    for at in positions(len(original), seed=len(name)):
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        path.write_bytes(bytes(damaged))
        with pytest.raises(BayesifyError):
            load_posterior(base_model(), directory)
    for cut in (0, 1, len(original) // 2, len(original) - 1):
        path.write_bytes(original[:cut])
        with pytest.raises(BayesifyError):
            load_posterior(base_model(), directory)
    path.write_bytes(original)
    assert loads_exactly_the_file(directory)


def test_resealed_tensor_flips_load_exactly_or_are_refused(saved):
    _, directory = saved
    path = directory / P.TENSOR_FILE
    original = path.read_bytes()
    outcomes = set()
    for at in positions(len(original), seed=7):
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        path.write_bytes(bytes(damaged))
        reseal(directory)  # checksums now agree with the damaged file
        outcomes.add(loads_exactly_the_file(directory))
    path.write_bytes(original[: len(original) - 8])
    reseal(directory)
    assert not loads_exactly_the_file(directory)  # a truncated file is never loaded
    assert outcomes == {True, False}  # header flips refused, data flips load as written


@pytest.mark.parametrize(("change", "match"), [
    (lambda m: m.pop("state"), "lacks the key 'state'"),
    (lambda m: m.pop("parameters"), "lacks the key 'parameters'"),
    (lambda m: m.update(config="components=2"), "'config' must be an object"),
    (lambda m: m.update(targets="fc"), "'targets' must be a list"),
    (lambda m: m.update(format_version=True), "invalid format_version True"),
    (lambda m: m.update(format_version=1.0), "invalid format_version 1.0"),
    (lambda m: m.update(method=["ibnn"]), "'method' must be a method name"),
    (lambda m: m.update(state=["fc.mean"]), "listed as parameters and as state"),
    (lambda m: m.update(config={**m["config"], "extra": 1}), "unknown option"),
    (lambda m: m.update(config={**m["config"], "prior_std": float("nan")}), "prior_std"),
    (lambda m: m.update(config={**m["config"], "components": 3}), "expects"),
    (lambda m: m.update(config={**m["config"], "deep": _nest(40)}), "nested deeper"),
])
def test_resealed_manifest_lies_are_refused(saved, change, match):
    _, directory = saved
    manifest = json.loads((directory / P.MANIFEST_FILE).read_text())
    change(manifest)
    manifest["checksum"] = P._manifest_checksum(manifest)
    (directory / P.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(BayesifyError, match=match):
        load_posterior(base_model(), directory)


def _nest(depth: int):
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def test_hostile_nesting_is_a_clear_error_not_recursion(saved):
    _, directory = saved
    (directory / P.MANIFEST_FILE).write_text('{"config": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(BayesifyError, match="nested too deeply|nested deeper"):
        load_posterior(base_model(), directory)


@pytest.mark.parametrize("components", [2e7, 20_000_000])
def test_untrusted_sizes_are_checked_before_allocating(saved, components):
    _, directory = saved
    reseal(directory, config={**json.loads((directory / P.MANIFEST_FILE).read_text())["config"],
                              "components": components})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    with pytest.raises(BayesifyError, match="components|expects"):
        load_posterior(base_model(), directory)
    assert time.perf_counter() - start < 5.0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown_mib < 200  # 2e7 components would need gigabytes


# ----------------------------------------------------------------- training checkpoints

@pytest.fixture(scope="module")
def checkpoint(digits, tmp_path_factory):
    x, y = digits.train.tensors
    keep = y < 5
    data = DataLoader(TensorDataset(x[keep][:32], y[keep][:32]), batch_size=16, shuffle=True)
    directory = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(1)
    bnn = bayesify(base_model(), "ibnn", components=2, samples=1)
    fit(bnn, data, epochs=1, lr=0.1, base_lr=1e-3, seed=0, progress=False,
        checkpoint_dir=directory)
    return C.list_checkpoints(directory)[-1]


def _same_content(a, b) -> bool:
    return C.content_checksum(a) == C.content_checksum(b)


def test_checkpoint_flips_and_truncations_are_never_loaded(checkpoint, tmp_path):
    reference = C.load_checkpoint(checkpoint)
    original = checkpoint.read_bytes()
    path = tmp_path / checkpoint.name
    refused = 0
    for at in positions(len(original), seed=3):
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        path.write_bytes(bytes(damaged))
        try:
            loaded = C.load_checkpoint(path)
        except BayesifyError:
            refused += 1
            continue
        # a flip in bytes torch never reads (zip padding, timestamps) changes nothing
        assert _same_content(loaded, reference), f"corrupt content loaded (byte {at})"
    assert refused >= POSITIONS // 2
    for cut in (0, 10, len(original) // 3, len(original) - 1):
        path.write_bytes(original[:cut])
        with pytest.raises(BayesifyError):
            C.load_checkpoint(path)
    path.write_bytes(original)
    assert _same_content(C.load_checkpoint(path), reference)  # the valid file: never refused


def test_resealed_checkpoint_lies_are_refused(checkpoint, tmp_path):
    raw = torch.load(checkpoint, weights_only=True)
    path = tmp_path / checkpoint.name

    def reseal_with(**changes):
        payload = {**raw, **changes}
        payload["checksum"] = C.content_checksum(payload)
        torch.save(payload, path)

    name = next(iter(raw["posterior"]))
    nan_posterior = {**raw["posterior"], name: torch.full_like(raw["posterior"][name], float("nan"))}
    for changes, match in [
        ({"posterior": nan_posterior}, "NaN/inf"),
        ({"meta": "[1, 2"}, "no readable metadata"),
        ({"meta": "[1, 2]"}, "no readable metadata"),
        ({"meta": "[" * 100_000 + "]" * 100_000}, "no readable metadata"),
        ({"rng": "seed"}, "RNG record"),
        ({"rng": [{"cpu": raw["rng"][0]["cpu"].float(), "noise": raw["rng"][0]["noise"]}]},
         "not a uint8 tensor"),
        ({"optimizer": None}, "lacks its 'optimizer' section"),
    ]:
        reseal_with(**changes)
        with pytest.raises(BayesifyError, match=match):
            C.load_checkpoint(path)
    reseal_with()  # re-sealing unchanged content: still valid
    assert _same_content(C.load_checkpoint(path), C.load_checkpoint(checkpoint))
