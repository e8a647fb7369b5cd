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

    printed = capsys.readouterr()
    wrote = printed.out.strip().splitlines()[-1]
    for name in ("posterior.safetensors", "bayesify.json", "base.safetensors", "run.json",
                 "history.jsonl"):  # the closing summary lists every file written
        assert f"{run / name}" in wrote, (name, wrote)
    assert not (tmp_path / "run.incomplete").exists()

    # --method is the posterior family in every command; calibrate's method is --calibration
    assert main(["calibrate", "--posterior", str(run), "--method", "temperature"]) == 2
    assert "--calibration" in capsys.readouterr().err
    assert not (run / "calibration.json").exists()
    # fit's validation search chose the temperature: calibrate moves it only with --force
    assert main(["calibrate", "--posterior", str(run), "--no-progress"]) == 2
    assert "--force" in capsys.readouterr().err
    assert not (run / "calibration.json").exists()
    assert main(["calibrate", "--posterior", str(run), "--method", "ibnn", "--calibration",
                 "temperature", "--no-progress", "--force"]) == 0
    printed = capsys.readouterr().out
    assert "calibration.json" in printed.strip().splitlines()[-1]
    calibration = json.loads((run / "calibration.json").read_text())
    assert calibration["nll_after"] <= calibration["nll_before"]
    # it starts from the temperature the fit stored, and says which one it applies (37.16)
    stored = json.loads((run / "run.json").read_text())["history"][-1]["temperature"]
    assert calibration["previous_temperature"] == pytest.approx(stored)
    said = printed.splitlines()
    assert said[0].startswith(f"applied temperature {calibration['temperature']:.4g} ")
    assert said[1].startswith(f"  started from {stored:.4g}, the posterior's own")
    assert (run / "calibration_reliability.png").is_file()

    assert main(["evaluate", "--posterior", str(run), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "ood_auroc_entropy" in printed and "accuracy" in printed
    result = json.loads((run / "evaluate" / "metrics.json").read_text())
    assert result["temperature"] == calibration["temperature"]
    assert result["nll"] == pytest.approx(calibration["test_nll_after"], rel=1e-5)
    assert {"reliability.png", "uncertainty_hist.png"} <= {p.name for p in (run / "evaluate").iterdir()}

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
    _, tv = sources.model_transforms(model, "torchvision:resnet18", image_size=32)
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
    assert "do not fit" in capsys.readouterr().err
    assert main(["fit", "--option", "components", "--no-progress"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_methods_command_still_lists_families(capsys):
    assert main(["methods"]) == 0
    assert "ibnn" in capsys.readouterr().out.split()
    assert main(["methods", "ibnn"]) == 0
    assert "components" in capsys.readouterr().out


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_fit_help_per_family(capsys):
    from bayesify.core.registry import get_method_class, list_methods

    generic = _help(["fit", "--help"], capsys)
    assert "--method NAME --help" in generic and "--components" not in generic
    assert "from --posterior" not in generic  # fit has no --posterior
    assert len(generic.splitlines()) < 100
    ibnn = _help(["fit", "--method", "ibnn", "--help"], capsys)
    assert "--components INT" in ibnn and "(default: 4)" in ibnn and "--cfg-" not in ibnn
    assert "--per-member-bn" not in ibnn  # another family's option
    for method in list_methods():
        text = _help(["fit", "--method", method, "--help"], capsys)
        assert len(text.splitlines()) < 170, method
        for name, default, _ in get_method_class(method).config_cls.describe():
            flag = "--" + name.replace("_", "-")
            renamed = f"--{method}-{name.replace('_', '-')}"
            assert flag in text or renamed in text, (method, name)
    swag = _help(["fit", "--method", "swag", "--help"], capsys)
    assert "--swag-lr FLOAT" in swag and "--swag-momentum FLOAT" in swag  # trainer owns --lr


def test_version(capsys):
    from bayesify import __version__

    assert _help(["--version"], capsys).strip() == f"bayesify {__version__}"


def test_fit_refuses_bad_arguments_before_any_work(tmp_path, capsys, monkeypatch):
    from bayesify.data import models

    def no_training(*args, **kwargs):
        raise AssertionError("MAP training started before the arguments were checked")

    monkeypatch.setattr(models, "train_map", no_training)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["fit", "--method", "nope", "--out", str(run)])
    assert done.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    for argv, message in (
        (["--option", "bogus=1"], "unknown option(s) ['bogus']"),
        (["--components", "0"], "components"),
        (["--fit-option", "bogus=1"], "unknown fit option(s) ['bogus']"),
        (["--data", str(tmp_path / "missing")], "is not a directory"),
        (["--checkpoint", str(tmp_path / "none.pt")], "does not exist"),
        (["--epochs", "0"], "--epochs must be >= 1"),
    ):
        assert main(["fit", "--out", str(run), "--no-progress", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
        assert not run.exists() and not (tmp_path / "run.incomplete").exists()


def test_failed_fit_leaves_no_partial_outputs(tmp_path, capsys):
    run = tmp_path / "run"
    stale = tmp_path / "run.incomplete"
    stale.mkdir()
    (stale / "junk.bin").write_text("left by an interrupted run")
    (stale / ".bayesify-staging").write_text("")  # an interrupted run's folder is marked
    # passes the checks, fails inside training: nothing reaches RUN, staging is removed
    assert main(["fit", "--map-epochs", "1", "--epochs", "1", "--out", str(run), *FAST,
                 "--fit-option", "lr_schedule=\"bogus\""]) == 2
    assert "bogus" in capsys.readouterr().err
    assert not run.exists() and not stale.exists()


def test_class_count_from_folder_checked_against_checkpoint_head(image_folder, tmp_path,
                                                                  capsys):
    model = sources.create_model("torchvision:resnet18", num_classes=5)
    torch.save(model.state_dict(), tmp_path / "r18_5.pth")
    out = tmp_path / "eval"
    assert main(["evaluate", "--data", str(image_folder), "--model", "torchvision:resnet18",
                 "--checkpoint", str(tmp_path / "r18_5.pth"), "--image-size", "32",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "5-class head" in err and "3 classes" in err and "fc.weight" in err
    assert not out.exists()
    # no class count given anywhere: the checkpoint's head decides
    again = sources.create_model("torchvision:resnet18", checkpoint=tmp_path / "r18_5.pth")
    assert again.fc.out_features == 5


def test_option_values_read_json_and_python_literals():
    from bayesify.cli_inputs import key_values

    got = key_values(["heads=False", "sharpen=true", "grid=[1, 2]", "n=4", "name=resnet",
                      "seed=None", "x=1.5"], "--option")
    assert got == {"heads": False, "sharpen": True, "grid": [1, 2], "n": 4, "name": "resnet",
                   "seed": None, "x": 1.5}
    assert got["heads"] is False and got["n"] == 4 and isinstance(got["n"], int)
