"""Exports that describe themselves and are not trusted blindly (issues 24.5 and 23.5).

- the format follows the file name; a contradicting ``format=`` is an error;
- class names, preprocessing, family and posterior fingerprint travel inside the
  ``.pt2`` / ONNX (and in ``FILE.json``); ``run_exported`` returns them and can
  replay the preprocessing on raw images;
- ``FILE.sha256`` is checked before loading: flipped bytes and a missing record are
  refused;
- crafted ``.pt2`` files that make ``torch.export.load`` run code (pickled sample
  inputs, pickled weights, custom objects, legacy archives, evaluated shape strings,
  a graph calling a Python function) are refused without running it, even with a
  matching sha256 record: the marker file the payload would write never appears.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import transforms as T

from bayesify import BayesifyError, bayesify
from bayesify.predict.export import load_exported, run_exported
from bayesify.predict.export_trust import sha256_of, write_sha256
from tests.test_registry_state import model

CLASSES = ["zero", "one", "two", "three", "four"]
PREPROCESS = T.Compose([T.Resize(8), T.CenterCrop(8), T.ToTensor(), T.Normalize([0.5], [0.25])])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One ibnn predictor exported as .pt2 and (by the name alone) as .onnx."""
    torch.manual_seed(0)
    predictor = bayesify(model(), "ibnn", components=2).predictor(samples_per_component=2)
    out = tmp_path_factory.mktemp("exports")
    x = torch.rand(2, 1, 8, 8)
    infos = {fmt: predictor.export(out / f"m.{fmt}", x, class_names=CLASSES,
                                   preprocessing=PREPROCESS)
             for fmt in ("pt2", "onnx")}
    return predictor, out, infos


def test_format_follows_the_file_name(exported, tmp_path):
    predictor, out, infos = exported
    assert infos["onnx"]["format"] == "onnx" and infos["pt2"]["format"] == "pt2"
    assert not zipfile.is_zipfile(out / "m.onnx") and zipfile.is_zipfile(out / "m.pt2")
    x = torch.rand(2, 1, 8, 8)
    for name, fmt in (("a.onnx", "pt2"), ("a.pt2", "onnx")):
        with pytest.raises(BayesifyError, match="holds the"):
            predictor.export(tmp_path / name, x, format=fmt)
    with pytest.raises(BayesifyError, match=r"name the\s+file .pt2"):
        predictor.export(tmp_path / "model.bin", x)
    assert not list(tmp_path.iterdir())  # nothing written on a refused call


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_metadata_travels_inside_and_beside_the_file(exported, fmt):
    _, out, infos = exported
    path = out / f"m.{fmt}"
    if fmt == "pt2":
        with zipfile.ZipFile(path) as archive:
            inside = json.loads(archive.read(next(n for n in archive.namelist()
                                                  if n.endswith("extra/bayesify.json"))))
    else:
        import onnx

        props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
        inside = json.loads(props["bayesify"])
        assert json.loads(props["class_names"]) == CLASSES
        assert json.loads(props["preprocessing"])["mean"] == [0.5]
    beside = json.loads((out / f"m.{fmt}.json").read_text())
    # FILE.json adds the program's size (checked before a reader hashes the program)
    assert beside.pop("program_bytes") == path.stat().st_size
    assert inside == beside == infos[fmt]["metadata"]
    assert inside["class_names"] == CLASSES and inside["method"] == "ibnn"
    assert inside["members"] == 4 and inside["num_classes"] == 5 and inside["inputs"] == ["x"]
    ops = [s["op"] for s in inside["preprocessing"]["steps"]]
    assert ops == ["resize", "center_crop", "to_tensor", "normalize"]
    assert inside["preprocessing"]["input_size"] == [1, 8, 8]
    assert len(inside["posterior_fingerprint"]) == 64 and inside["base_fingerprint"]
    assert inside["posterior_fingerprint"] == infos["pt2"]["metadata"]["posterior_fingerprint"]


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_run_exported_reports_and_applies_the_metadata(exported, fmt):
    from PIL import Image

    predictor, out, _ = exported
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (12, 12), dtype=np.uint8)) for _ in range(3)]
    x = torch.stack([PREPROCESS(im) for im in images])
    result = run_exported(out / f"m.{fmt}", images, preprocess=True)
    probs, epistemic = result  # still unpacks as before
    reference = predictor(x)
    torch.testing.assert_close(probs, reference.probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(epistemic, reference.epistemic, atol=1e-5, rtol=0)
    assert result.class_names == CLASSES
    assert result.predicted_names() == [CLASSES[i] for i in reference.probs.argmax(-1).tolist()]
    loaded = load_exported(out / f"m.{fmt}")
    assert loaded.metadata["method"] == "ibnn" and loaded.preprocessing["std"] == [0.25]


def test_timm_models_record_their_own_preprocessing(tmp_path):
    import timm

    net = timm.create_model("resnet18", pretrained=False, num_classes=3).eval()
    predictor = bayesify(net, "ibnn", components=1, targets="last_layer").predictor(
        samples_per_component=1)
    info = predictor.export(tmp_path / "r.pt2", torch.rand(1, 3, 32, 32))
    pre = info["metadata"]["preprocessing"]
    assert pre["source"].startswith("timm") and pre["input_size"] == [3, 224, 224]
    assert pre["interpolation"] == "bicubic" and pre["mean"] == pytest.approx([0.485, 0.456, 0.406])
    assert info["metadata"]["class_names"] is None  # nothing to say: not invented


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_flipped_bytes_and_missing_records_are_refused(exported, fmt, tmp_path):
    _, out, _ = exported
    data = bytearray((out / f"m.{fmt}").read_bytes())
    start = len(data) // 2
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])  # 64 flipped bytes
    damaged = tmp_path / f"d.{fmt}"
    damaged.write_bytes(bytes(data))
    (tmp_path / f"d.{fmt}.sha256").write_text((out / f"m.{fmt}.sha256").read_text())
    with pytest.raises(BayesifyError, match="does not match its integrity record"):
        run_exported(damaged, torch.rand(2, 1, 8, 8))
    (tmp_path / f"d.{fmt}.sha256").unlink()
    with pytest.raises(BayesifyError, match="no integrity record"):
        run_exported(damaged, torch.rand(2, 1, 8, 8))


# -- crafted .pt2 files ---------------------------------------------------------------------
class Payload:
    """Unpickling it creates ``marker`` (what an attacker's code would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _records(path: Path) -> tuple[str, dict[str, bytes]]:
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        root = names[0].split("/", 1)[0]
        return root, {n.split("/", 1)[1]: archive.read(n) for n in names}


def _write(path: Path, root: str, records: dict[str, bytes]) -> Path:
    """A zip archive like torch's (stored, one root) and a *matching* sha256 record."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records.items():
            archive.writestr(f"{root}/{name}", data)
    write_sha256(path, sha256_of(path.read_bytes()))
    return path


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _program(records: dict[str, bytes]) -> dict:
    return json.loads(records["models/model.json"])


def craft(kind: str, source: Path, target: Path, marker: Path) -> Path:
    root, records = _records(source)
    payload = _saved(Payload(marker))
    if kind == "sample_inputs":
        records["data/sample_inputs/model.pt"] = payload
    elif kind == "pickled_weight":
        config = json.loads(records["data/weights/model_weights_config.json"])
        entry = next(iter(config["config"].values()))
        entry["use_pickle"] = True
        records[f"data/weights/{entry['path_name']}"] = payload
        records["data/weights/model_weights_config.json"] = json.dumps(config).encode()
    elif kind == "opaque_constant":
        config = json.loads(records["data/constants/model_constants_config.json"])
        config["config"]["evil"] = {"path_name": "opaque_obj_0", "is_param": False,
                                    "use_pickle": True, "tensor_meta": None}
        records["data/constants/opaque_obj_0"] = pickle.dumps(Payload(marker))
        records["data/constants/model_constants_config.json"] = json.dumps(config).encode()
    elif kind == "legacy":
        records = {"version": b"8.0", "serialized_exported_program.json": b"{}",
                   "serialized_state_dict.pt": payload, "serialized_constants.pt": payload,
                   "serialized_example_inputs.pt": payload}
    elif kind == "sympy_eval":
        text = records["models/model.json"].decode()
        symbol = re.search(r"Symbol\('s\d+', positive=True, integer=True\)", text).group(0)
        code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
        records["models/model.json"] = text.replace(symbol, code, 1).encode()
    elif kind == "guard_code":
        program = _program(records)
        program["guards_code"] = [f"__import__('os').system('touch {marker}') == 0"]
        records["models/model.json"] = json.dumps(program).encode()
    elif kind == "python_target":
        text = records["models/model.json"].decode()
        records["models/model.json"] = text.replace('"torch.ops.aten.relu.default"',
                                                    '"torch.os.system"', 1).encode()
    elif kind == "shared_library":
        records["aotinductor/model/model.so"] = b"\x7fELF"
    return _write(target, root, records)


@pytest.fixture(scope="module")
def plain_pt2(tmp_path_factory):
    """A .pt2 with a dynamic batch (symbolic shapes) and a relu node."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    predictor = bayesify(net, "ibnn", components=1).predictor(samples_per_component=1)
    path = tmp_path_factory.mktemp("plain") / "p.pt2"
    predictor.export(path, torch.rand(2, 4))
    return path


KINDS = ["sample_inputs", "pickled_weight", "opaque_constant", "legacy", "sympy_eval",
         "guard_code", "python_target", "shared_library"]


@pytest.mark.parametrize("kind", KINDS)
def test_crafted_pt2_is_refused_without_running_it(plain_pt2, kind, tmp_path):
    marker = tmp_path / "pwned"
    crafted = craft(kind, plain_pt2, tmp_path / "crafted.pt2", marker)
    with pytest.raises(BayesifyError, match="refusing"):
        run_exported(crafted, torch.rand(3, 4))
    with pytest.raises(BayesifyError, match="refusing"):
        load_exported(crafted, check_sha256=False)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["sample_inputs", "sympy_eval"])
def test_the_crafted_files_do_run_code_in_plain_torch(plain_pt2, kind, tmp_path):
    """The attacks above are real: torch.export.load itself executes these payloads."""
    marker = tmp_path / "pwned"
    crafted = craft(kind, plain_pt2, tmp_path / "crafted.pt2", marker)
    try:
        torch.export.load(str(crafted)).module()
    except Exception:  # noqa: BLE001, S110 - the payload ran before torch gave up
        pass
    assert marker.exists()


def test_pt2_export_is_quiet(tmp_path):
    """torch's "No complete tensor found in the group" (Laplace's exported tensors share one
    storage) does not leak out of export; a bare torch.export.save of the program warns."""
    import warnings

    from bayesify import fit
    from bayesify.predict.export import build_exported_predictor, export_program
    from tests.test_registry_state import loader

    bnn = bayesify(model(), "laplace", structure="kron")  # its tensors share one storage
    fit(bnn, loader(), progress=False)
    x = torch.rand(2, 1, 8, 8)
    with warnings.catch_warnings(record=True) as bare:
        warnings.simplefilter("always")
        program = export_program(build_exported_predictor(bnn.predictor(), x), x)
        torch.export.save(program, io.BytesIO())
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        bnn.predictor().export(tmp_path / "q.pt2", x)
    assert [w for w in bare if "complete tensor" in str(w.message)]
    assert not [w for w in ours if "complete tensor" in str(w.message)]
    with zipfile.ZipFile(tmp_path / "q.pt2") as archive:
        assert {n.split("/", 1)[0] for n in archive.namelist()} == {"archive"}
