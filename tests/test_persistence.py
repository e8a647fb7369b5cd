"""save_posterior / load_posterior: round trip, fingerprint, tampering, no pickle."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file

from bayesify import BayesifyError, bayesify, load_posterior
from bayesify import persistence as P
from bayesify.core import registry
from bayesify.data.models import DigitsCNN
from bayesify.methods.ibnn.method import IBNNMethod


@pytest.fixture()
def saved(digits_map, tmp_path):
    """An iBNN posterior with non-trivial values, saved to ``tmp_path/post``."""
    torch.manual_seed(1)
    bnn = bayesify(digits_map, "ibnn", components=3, prior_std=0.2, targets="last:2")
    with torch.no_grad():
        for p in bnn.posterior_parameters():
            p.add_(0.1 * torch.randn_like(p))
    bnn.save_posterior(tmp_path / "post")
    return bnn, tmp_path / "post"


def test_round_trip_on_a_fresh_copy_gives_identical_predictions(saved, digits_map, digits):
    bnn, directory = saved
    assert sorted(p.name for p in directory.iterdir()) == ["bayesify.json", "posterior.safetensors"]
    fresh = copy.deepcopy(digits_map)
    loaded = load_posterior(fresh, directory)
    assert loaded.method_name == "ibnn" and loaded.posterior_config == bnn.posterior_config
    assert loaded.targets == bnn.targets
    for (n1, p1), (n2, p2) in zip(bnn.named_posterior_parameters(), loaded.named_posterior_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    x = digits.test.tensors[0][:20]
    assert torch.equal(bnn.predictor(seed=5)(x).probs, loaded.predictor(seed=5)(x).probs)
    assert all(p.data_ptr() != q.data_ptr() for p, q in
               zip(fresh.parameters(), loaded.base_parameters()))  # the caller's model is copied


def test_manifest_and_tensor_keys(saved, digits_map):
    bnn, directory = saved
    manifest = json.loads((directory / "bayesify.json").read_text())
    assert manifest["format_version"] == P.FORMAT_VERSION and manifest["method"] == "ibnn"
    assert manifest["config"]["components"] == 3 and manifest["config"]["prior_std"] == 0.2
    assert manifest["targets"] == bnn.targets
    assert manifest["base_fingerprint"] == P.fingerprint(digits_map.state_dict())
    tensors = load_file(str(directory / "posterior.safetensors"))
    # keys are the base model's module names (family-level state under "bayesify.")
    assert sorted(tensors) == sorted(bnn.posterior_tensors())
    assert "bayesify.temperature" in tensors
    assert all(k.rsplit(".", 1)[0] in dict(digits_map.named_modules())
               for k in tensors if not k.startswith("bayesify."))


def test_fingerprint_is_sha256_over_sorted_names_and_bytes():
    state = {"b": torch.arange(3, dtype=torch.float32), "a": torch.tensor([True, False])}
    lines = []
    for name in ("a", "b"):
        t = state[name]
        digest = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.numpy().tobytes())
        lines.append(f"{name}={digest.hexdigest()}")
    manual = hashlib.sha256("\n".join(lines).encode())
    assert P.fingerprint(state) == manual.hexdigest()
    assert P.fingerprint(dict(reversed(state.items()))) == manual.hexdigest()
    nudged = {**state, "b": torch.nextafter(state["b"], torch.tensor(9.0))}
    assert P.fingerprint(nudged) != manual.hexdigest()
    assert P.fingerprint({**state, "b": state["b"].double()}) != manual.hexdigest()


def test_a_different_base_model_is_refused(saved, digits_map):
    _, directory = saved
    other = copy.deepcopy(digits_map)
    with torch.no_grad():
        other.fc.bias[0] += 1e-3
    with pytest.raises(BayesifyError, match="not the one this posterior was fitted on"):
        load_posterior(other, directory)
    with pytest.raises(BayesifyError, match="not the one"):
        load_posterior(DigitsCNN(5, width=16), directory)


def _rewrite(directory, tensors=None, **fields):
    """Rewrite the saved files consistently (valid sha256 and checksum): a well-formed lie."""
    if tensors is not None:
        save_file(tensors, str(directory / P.TENSOR_FILE))
    manifest = json.loads((directory / P.MANIFEST_FILE).read_text())
    manifest.update(fields)
    manifest["posterior_sha256"] = P._file_sha256(directory / P.TENSOR_FILE)
    manifest["posterior_bytes"] = (directory / P.TENSOR_FILE).stat().st_size
    manifest["checksum"] = P._manifest_checksum(manifest)
    (directory / P.MANIFEST_FILE).write_text(json.dumps(manifest))


def test_missing_and_extra_tensors_are_refused(saved, digits_map):
    _, directory = saved
    tensors = load_file(str(directory / P.TENSOR_FILE))
    name = min(tensors)
    _rewrite(directory, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(BayesifyError, match=f"missing \\['{name}'\\]"):
        load_posterior(digits_map, directory)
    _rewrite(directory, {**tensors, "fc.surprise": torch.zeros(2)})
    with pytest.raises(BayesifyError, match="unexpected \\['fc.surprise'\\]"):
        load_posterior(digits_map, directory)
    _rewrite(directory, {**tensors, name: torch.zeros(7)})
    with pytest.raises(BayesifyError, match="expects"):
        load_posterior(digits_map, directory)


def test_tampered_files_are_refused(saved, digits_map):
    _, directory = saved
    tensor_path, manifest_path = directory / P.TENSOR_FILE, directory / P.MANIFEST_FILE
    original = tensor_path.read_bytes()
    tensor_path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(BayesifyError, match="tensor file was modified"):
        load_posterior(digits_map, directory)
    tensor_path.write_bytes(original)

    text = manifest_path.read_text()
    manifest_path.write_text(text.replace('"prior_std": 0.2', '"prior_std": 0.3'))
    with pytest.raises(BayesifyError, match="modified after it was written"):
        load_posterior(digits_map, directory)
    manifest_path.write_text(text[:-5])
    with pytest.raises(BayesifyError, match="not valid JSON"):
        load_posterior(digits_map, directory)
    manifest_path.write_text(text)

    _rewrite(directory, format_version=P.FORMAT_VERSION + 1)
    with pytest.raises(BayesifyError, match="newer than this bayesify supports"):
        load_posterior(digits_map, directory)
    _rewrite(directory, format_version=P.FORMAT_VERSION, method="no_such_family")
    with pytest.raises(BayesifyError, match="unknown method"):
        load_posterior(digits_map, directory)
    _rewrite(directory, method="ibnn")
    tensor_path.unlink()
    with pytest.raises(BayesifyError, match="missing"):
        load_posterior(digits_map, directory)
    with pytest.raises(BayesifyError, match="not a saved posterior"):
        load_posterior(digits_map, directory / "nowhere")


def test_load_never_unpickles(saved, digits_map, monkeypatch):
    _, directory = saved

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling in the load path")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    assert load_posterior(digits_map, directory).method_name == "ibnn"


class ScaledIBNN(IBNNMethod):
    """iBNN plus a per-layer buffer (a stand-in for SWAG moments) saved as posterior state."""

    name = "persistence_test_state"
    wrappers: ClassVar = dict(IBNNMethod.wrappers)

    def prepare(self, bnn):  # buffers are posterior state: no save/load hook needed
        for layer in bnn.bayesian_layers().values():
            layer.register_buffer("moment", torch.zeros(layer.mean.shape[1]))


def test_family_state_round_trips_through_the_hook(digits_map, tmp_path, monkeypatch):
    cls = ScaledIBNN
    monkeypatch.setitem(registry._METHODS, cls.name, f"{cls.__module__}:{cls.__qualname__}")
    bnn = bayesify(digits_map, cls.name, components=2)
    for layer in bnn.bayesian_layers().values():
        layer.moment.normal_()
    bnn.save_posterior(tmp_path)
    manifest = json.loads((tmp_path / P.MANIFEST_FILE).read_text())
    assert manifest["state"] == sorted([f"{n}.moment" for n in bnn.bayesian_layers()]
                                       + ["bayesify.temperature"])
    loaded = load_posterior(copy.deepcopy(digits_map), tmp_path)
    for name, layer in loaded.bayesian_layers().items():
        assert torch.equal(layer.moment, bnn.bayesian_layers()[name].moment)
    # a family without that state refuses a file that carries it
    _rewrite(tmp_path, method="ibnn")
    with pytest.raises(BayesifyError, match="unexpected"):
        load_posterior(digits_map, tmp_path)
