"""The ``bayesify`` CLI in-process: fit → calibrate → evaluate → export on digits and folders."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from bayesify import load_posterior
from bayesify.cli import COMMANDS, build_parser, main
from bayesify.data import sources
from bayesify.predict.export import run_exported

FAST = ["--no-progress", "--option", "components=2", "--option", "predict_samples=1"]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """train/ and val/ with three classes of four generated 32×32 JPEGs each."""
    from PIL import Image

    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, colour in enumerate(((200, 30, 30), (30, 200, 30), (30, 30, 200))):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True)
            for i in range(4):
                pixels = np.clip(rng.normal(colour, 40, size=(32, 32, 3)), 0, 255)
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.jpg")
    return root


def test_every_flag_of_every_command_is_documented(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS) >= {"fit", "evaluate", "calibrate", "export", "demo"}
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"`bayesify {name}` flag {action.option_strings} has no help"
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0
        assert "usage: bayesify " + name in capsys.readouterr().out


def test_digits_fit_calibrate_evaluate_export(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--data", "digits", "--map-epochs", "3", "--epochs", "1",
                 "--out", str(run), *FAST]) == 0
    for name in ("posterior.safetensors", "bayesify.json", "base.safetensors", "run.json",
                 "history.jsonl"):
        assert (run / name).is_file(), name
    spec = json.loads((run / "run.json").read_text())
    assert spec["model"] == "digits-cnn" and spec["data"] == "digits"

    assert main(["calibrate", "--posterior", str(run), "--no-progress"]) == 0
    calibration = json.loads((run / "calibration.json").read_text())
    assert calibration["nll_after"] <= calibration["nll_before"]
    assert (run / "calibration_reliability.png").is_file()

    assert main(["evaluate", "--posterior", str(run), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "ood_auroc_entropy" in printed and "accuracy" in printed
    result = json.loads((run / "evaluate" / "metrics.json").read_text())
    assert result["temperature"] == calibration["temperature"]
    assert result["nll"] == pytest.approx(calibration["test_nll_after"], rel=1e-5)
    assert {"reliability.png", "entropy_hist.png"} <= {p.name for p in (run / "evaluate").iterdir()}

    # the same predictor rebuilt by hand agrees with what evaluate and export saw
    base = sources.create_model("digits-cnn", num_classes=5, in_channels=1,
                                checkpoint=run / "base.safetensors")
    predictor = load_posterior(base, run).predictor(seed=0)
    predictor.temperature = calibration["temperature"]
    data = sources.build_data("digits", base, "digits-cnn")
    assert predictor.evaluate(data.loaders()["test"])["nll"] == pytest.approx(result["nll"],
                                                                              rel=1e-5)
    assert main(["export", "--posterior", str(run), "--output", str(tmp_path / "p.pt2")]) == 0
    x = data.test.tensors[0][:11]
    probs, epistemic = run_exported(tmp_path / "p.pt2", x)
    torch.testing.assert_close(probs, predictor(x).probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(epistemic, predictor(x).epistemic, atol=1e-5, rtol=0)


def test_image_folder_with_timm_and_torchvision(image_folder, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--data", str(image_folder), "--model", "timm:resnet18",
                 "--image-size", "32", "--epochs", "1", "--batch-size", "6",
                 "--out", str(run), *FAST]) == 0
    assert "randomly initialised" in capsys.readouterr().err
    assert main(["evaluate", "--posterior", str(run), "--no-plots", "--no-progress"]) == 0
    result = json.loads((run / "evaluate" / "metrics.json").read_text())
    assert result["n"] == 12 and result["members"] == 2 and result["model"] == "timm:resnet18"

    # MAP evaluation of a torchvision model from a torch.save'd state_dict (weights_only)
    model = sources.create_model("torchvision:resnet18", num_classes=3)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "tv.pt")
    out = tmp_path / "tv-eval"
    assert main(["evaluate", "--data", str(image_folder), "--model", "torchvision:resnet18",
                 "--checkpoint", str(tmp_path / "tv.pt"), "--image-size", "32",
                 "--out", str(out), "--no-plots", "--no-progress"]) == 0
    assert json.loads((out / "metrics.json").read_text())["method"] == "map"


def test_preprocessing_comes_from_the_model(image_folder):
    from timm.data import create_transform, resolve_model_data_config

    model = sources.create_model("timm:resnet18", num_classes=3)
    data = sources.build_data(str(image_folder), model, "timm:resnet18", image_size=32)
    assert data.num_classes == 3 and data.class_names == ["class_0", "class_1", "class_2"]
    transform = create_transform(**resolve_model_data_config(
        model, args={"input_size": (3, 32, 32)}), is_training=False)
    path, _ = data.train.samples[0]
    from PIL import Image

    expected = transform(Image.open(path).convert("RGB"))
    assert torch.equal(data.train[0][0], expected) and expected.shape == (3, 32, 32)
    tv = sources.model_transform(model, "torchvision:resnet18", image_size=32)
    assert tv(Image.open(path).convert("RGB")).shape == (3, 32, 32)


class _NotWeights:
    pass


def test_bad_inputs_are_clear_errors(image_folder, tmp_path, capsys):
    torch.save({"state_dict": {"w": _NotWeights()}}, tmp_path / "evil.pt")
    code = main(["evaluate", "--data", str(image_folder), "--model", "digits-cnn",
                 "--checkpoint", str(tmp_path / "evil.pt"), "--no-progress"])
    assert code == 2 and "weights-only" in capsys.readouterr().err
    assert main(["evaluate", "--data", str(tmp_path), "--no-progress"]) == 2
    assert "train/ and" in capsys.readouterr().err
    assert main(["evaluate", "--model", "keras:resnet", "--no-progress"]) == 2
    assert "unknown model" in capsys.readouterr().err
    sources.save_checkpoint(sources.create_model("digits-cnn", num_classes=5), tmp_path / "w.safetensors")
    assert main(["evaluate", "--model", "timm:resnet18", "--checkpoint",
                 str(tmp_path / "w.safetensors"), "--no-progress"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["fit", "--option", "components", "--no-progress"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_methods_command_still_lists_families(capsys):
    assert main(["methods"]) == 0
    assert "ibnn" in capsys.readouterr().out.split()
    assert main(["methods", "ibnn"]) == 0
    assert "components" in capsys.readouterr().out
