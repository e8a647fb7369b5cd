"""The CLI / script papercuts of issue 24.7, one test each.

- no argparse prefix matching (``--component 4`` is refused, not read as --components);
- a resume whose global batch differs from the checkpoint's is refused before the
  plan, naming the ``--batch-size`` that fits, without a traceback;
- run.json paths are relative to the run, so a run directory moves with its data;
- ``bayesify fit --out`` and the script write one layout that ``--posterior`` reads;
- ``calibrate --help`` sets the base-model flags apart and its output stays narrow;
- per-family help is the family's page (short);
- post-hoc MC dropout is tuned on validation without a training pass;
- ``summary()`` counts posterior state (Laplace) and says weights, not nodes (SWAG).
(Callbacks receiving a LossTerms vs a dict: left to the training-loop rewrite.)
"""

from __future__ import annotations

import json
import shutil

import pytest

from bayesify.cli import main
from tests.test_cli import FAST, image_folder  # noqa: F401 - the fixture
from tests.test_imagenet_script import _script, make_image_folder


def _script_argv(data, out, *extra):
    return ["--model", "torchvision:resnet18", "--data", str(data), "--image-size", "32",
            "--epochs", "1", "--components", "2", "--predict-samples", "1", "--out", str(out),
            "--no-progress", "--device", "cpu", "--workers", "0", *extra]


@pytest.mark.parametrize("argv", [["fit", "--component", "4"], ["fit", "--epoch", "1"],
                                  ["calibrate", "--post", "run"], ["demo", "--epoch", "1"]])
def test_abbreviated_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_the_script_refuses_abbreviated_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        _script().main(["--model", "timm:resnet18", "--data", str(tmp_path), "--out",
                        str(tmp_path / "o"), "--component", "4"])
    assert done.value.code == 2 and "unrecognized arguments: --component" in capsys.readouterr().err


def test_script_layout_resume_batch_and_portable_run(tmp_path, capsys):
    """One script run, then: a resume with another global batch is refused up front; the
    run directory is the `bayesify fit` layout with relative paths, so `bayesify
    calibrate --posterior OUT` reads it, also after OUT and the data moved together."""
    import torch

    from bayesify.data.sources import create_model
    from bayesify.train.imagenet import check_resume_batch

    # 3 validation images per class: calibration refuses fewer than 5 labelled examples
    data = make_image_folder(tmp_path / "work" / "data", val=3)
    out = tmp_path / "work" / "out"
    torch.manual_seed(0)
    torch.save(create_model("torchvision:resnet18", num_classes=2).state_dict(),
               tmp_path / "work" / "r18.pth")
    checkpoint = ["--checkpoint", str(tmp_path / "work" / "r18.pth")]
    try:
        _script().main(_script_argv(data, out, "--batch-size", "4", *checkpoint))
        worse = False
    except SystemExit as done:  # one epoch from a random network on 6 validation images:
        worse = done.code == 3  # a posterior worse than its start is written, exit 3
        assert worse and "worse on validation" in capsys.readouterr().err
    for name in ("posterior.safetensors", "bayesify.json", "run.json", "history.jsonl",
                 "final_metrics.json", "args.json"):
        assert (out / name).is_file(), name  # the layout of `bayesify fit --out`
    assert not (out / "posterior").exists() and not (out / "posterior.incomplete").exists()
    run = json.loads((out / "run.json").read_text())
    assert run["data"] == "../data" and run["checkpoint"] == "../r18.pth"
    assert run["paths"] == "relative to this run directory"
    capsys.readouterr()

    history = (out / "history.jsonl").read_text()
    with pytest.raises(SystemExit) as done:  # 1 process × 2 ≠ the checkpoint's 1 × 4
        _script().main(_script_argv(data, out, "--batch-size", "2", "--epochs", "2", *checkpoint))
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--batch-size 4" in err and "Traceback" not in err
    assert "nothing was trained or written" in err and (out / "history.jsonl").read_text() == history
    with pytest.raises(Exception, match=r"2 process\(es\) × --batch-size 4 = 8: pass --batch-size 2"):
        check_resume_batch(out / "checkpoints", batch_size=4, world_size=2)

    if worse:  # calibrate refuses such a run; the rest checks the layout, so drop the mark
        assert main(["calibrate", "--posterior", str(out), "--no-progress"]) == 2
        assert "calibrating it would hide that" in capsys.readouterr().err
        run["outcome"]["worse_than_start"] = False
        (out / "run.json").write_text(json.dumps(run))
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "work", moved)
    shutil.rmtree(tmp_path / "work")
    assert main(["calibrate", "--posterior", str(moved / "out"), "--no-progress",
                 "--force"]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if str(tmp_path) not in line]  # not paths
    assert max(len(line) for line in rows) < 100  # the 42-point curve is summarised
    assert "curve.temperature_grid     42 values" in printed
    assert json.loads((moved / "out" / "calibration.json").read_text())["temperature"] > 0


def test_cli_fit_records_relative_paths(image_folder, tmp_path):  # noqa: F811
    run = tmp_path / "runs" / "r"
    assert main(["fit", "--data", str(image_folder), "--model", "timm:resnet18",
                 "--image-size", "32", "--epochs", "1", "--batch-size", "6",
                 "--out", str(run), *FAST]) == 0
    record = json.loads((run / "run.json").read_text())
    assert not record["data"].startswith("/") and (run / record["data"]).resolve() == \
        image_folder.resolve()
    assert json.loads((run / "final_metrics.json").read_text())["n"] == 12


def test_calibrate_help_sets_base_model_flags_apart(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    text = capsys.readouterr().out
    assert "base model and data (read from --posterior's run.json" in text
    assert "training batch" not in text and "MAP baseline only" in text


@pytest.mark.parametrize("method", ["ibnn", "swag", "hypernet", "laplace"])
def test_per_family_help_is_the_family_page(method, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--method", method, "--help"])
    text = capsys.readouterr().out
    # the family's options with their whole help texts (issue 37.14): the longest page is
    # SWAG's, ~100 lines
    assert len(text.splitlines()) < 110 and f"options of --method {method}" in text
    assert "--base-lr" not in text and "`bayesify fit --help`" in " ".join(text.split())
    with pytest.raises(SystemExit):
        _script().main(["--method", method, "--help"])
    assert len(capsys.readouterr().out.splitlines()) < 115


def test_post_hoc_dropout_is_tuned_without_training(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--method", "dropout", "--no-train-weights", "--map-epochs", "3",
                 "--out", str(run), "--no-progress"]) == 0
    assert "no training epochs" in capsys.readouterr().err
    history = json.loads((run / "run.json").read_text())["history"]
    assert len(history) == 1 and history[0]["steps"] == 0
    assert history[0]["dropout_rate_scale"] in history[0]["dropout_rate_scale_grid"]
    assert history[0]["heads_n_data"] > 0  # its Laplace heads fitted, as fit fits them
    assert not (run / "history.jsonl").exists()  # no epoch ran


def test_summary_counts_posterior_state_and_names_weights():
    from bayesify import bayesify, fit
    from tests.test_registry_state import loader, model

    laplace = bayesify(model(), "laplace")
    fit(laplace, loader(), progress=False)
    text = laplace.summary()
    # structure='auto' on a 45-parameter head: the full 45 × 45 GGN (2025) is state, and
    # the sums of its feature layer (the 8-channel BatchNorm: 8 + 8 × 8 + 2 = 74)
    assert "random weights" in text and "0 trainable + 2105 state" in text
    kron = bayesify(model(), "laplace", structure="kron")
    fit(kron, loader(), progress=False)
    assert "0 trainable + 186 state" in kron.summary()  # 112 + the feature layer's 74
    swag = bayesify(model(), "swag")
    assert "random weights per member: 709" in swag.summary()
    assert "random nodes per member: 17" in bayesify(model(), "ibnn").summary()
