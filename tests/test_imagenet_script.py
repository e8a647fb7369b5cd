"""examples/finetune_imagenet.py and bayesify.train.imagenet on a tiny generated ImageFolder.

The script runs for real under ``torchrun --nproc_per_node=2`` (gloo, CPU): timm
resnet18 (random init, saved and passed with --checkpoint), 2 classes × 4 train /
2 val JPEGs of 32×32, one epoch, validation, checkpoint and the final posterior.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from bayesify import BayesifyError
from bayesify.data import sources
from bayesify.data.model_source import (
    create_model,
    model_transforms,
    parse_model_spec,
    read_state_dict,
)
from bayesify.train.imagenet import family_options

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "finetune_imagenet.py"


def _script():
    spec = importlib.util.spec_from_file_location("finetune_imagenet", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_image_folder(root: Path, *, classes: int = 2, train: int = 4, val: int = 2) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                base = torch.full((32, 32, 3), 60.0 + 120.0 * c)
                pixels = (base + 40 * torch.rand(32, 32, 3, generator=g)).clamp(0, 255)
                Image.fromarray(pixels.byte().numpy()).save(folder / f"{i}.jpg")
    return root


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        _script().main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_is_per_family(capsys):
    from bayesify.core.registry import get_method_class, list_methods

    generic = _help(["--help"], capsys)
    assert "--method NAME --help" in generic and "--components" not in generic
    for flag in ("--model", "--pretrained", "--checkpoint", "--data", "--method", "--lr-schedule",
                 "--base-lr", "--batch-size", "--workers", "--resume", "--amp",
                 "--channels-last", "--compile", "--grad-accum-steps", "--version"):
        assert flag in generic
    assert len(generic.splitlines()) < 140
    for method in list_methods():
        text = _help(["--method", method, "--help"], capsys)
        assert len(text.splitlines()) < 210 and "--cfg-" not in text, method
        for name, default, help_text in get_method_class(method).config_cls.describe():
            plain, prefixed = "--" + name.replace("_", "-"), f"--{method}-{name.replace('_', '-')}"
            assert plain in text or prefixed in text, (method, name)
    ibnn = _help(["--method", "ibnn", "--help"], capsys)
    assert "--components INT" in ibnn and "(default: 4)" in ibnn and "--p FLOAT" not in ibnn
    swag = _help(["--method", "swag", "--help"], capsys)
    assert "--swag-lr FLOAT" in swag and "--swag-momentum FLOAT" in swag and "(default: 0.001)" in swag


def test_method_flags_become_typed_config_options():
    parser = _script().build_parser("ibnn")
    args = parser.parse_args(["--model", "timm:resnet18", "--data", "d", "--out", "o",
                              "--components", "8", "--prior-std", "0", "--init-std", "0.05",
                              "0.02", "--no-learn-std", "--targets", "last_layer"])
    opts = family_options(args, "ibnn")
    assert opts == {"components": 8, "prior_std": 0.0, "init_std": (0.05, 0.02),
                    "learn_std": False, "targets": "last_layer"}
    assert isinstance(opts["prior_std"], float)
    with pytest.raises(SystemExit):  # dropout's option is not an ibnn flag
        parser.parse_args(["--model", "timm:resnet18", "--data", "d", "--out", "o", "--p", "0.2"])
    swag = _script().build_parser("swag").parse_args(
        ["--model", "m", "--data", "d", "--out", "o", "--swag-lr", "0.05", "--lr", "0.3"])
    assert family_options(swag, "swag") == {"lr": 0.05} and swag.lr == 0.3


def test_model_loading_and_preprocessing(tmp_path):
    with pytest.raises(BayesifyError, match="SOURCE:NAME"):
        parse_model_spec("resnet50")
    model = create_model("timm:resnet18", num_classes=3)
    state = {f"module.{k}": v for k, v in model.state_dict().items()}  # DDP-style prefix
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "ck.pth")
    assert read_state_dict(tmp_path / "ck.pth").keys() == model.state_dict().keys()
    again = create_model("timm:resnet18", checkpoint=tmp_path / "ck.pth")  # head decides: 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values()))
    with pytest.raises(BayesifyError, match=r"3-class head \(fc.weight.*gives 5 classes"):
        create_model("timm:resnet18", num_classes=5, checkpoint=tmp_path / "ck.pth")
    from PIL import Image

    img = Image.new("RGB", (40, 40), (128, 10, 200))
    train_tf, eval_tf = model_transforms(model, "timm:resnet18", image_size=32)
    assert eval_tf(img).shape == (3, 32, 32) and train_tf(img).shape == (3, 32, 32)
    tv_model = create_model("torchvision:resnet18")
    _, tv_eval = model_transforms(tv_model, "torchvision:resnet18")  # preset, no download
    assert tv_eval(img).shape == (3, 224, 224)


def test_batch_plan_drops_only_with_trained_batchnorm():
    plan = sources.plan_batches(60, batch_size=16, world_size=2)
    assert (plan.batches, plan.dropped, plan.drop_last) == (2, 0, False)
    plan = sources.plan_batches(60, batch_size=16, world_size=2, bn_train=True)
    assert (plan.batches, plan.dropped, plan.drop_last) == (1, 28, True)
    assert "leaves out 28 image(s)" in plan.describe()
    assert "16 per process × 2 process(es) = global batch 32" in plan.describe()
    assert sources.plan_batches(8, batch_size=32, world_size=2).batches == 1
    with pytest.raises(BayesifyError, match=r"8 images.*global batch of 64.*--batch-size 4"):
        sources.plan_batches(8, batch_size=32, world_size=2, bn_train=True)


def test_workers_follow_the_cpus(monkeypatch):
    monkeypatch.setattr(sources, "available_cpus", lambda: 2)
    assert sources.default_workers(processes=1) == 0
    monkeypatch.setattr(sources, "available_cpus", lambda: 16)
    assert sources.default_workers(processes=2) == 7
    assert sources.default_workers(processes=1) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node=4: 4 CPUs each
    assert sources.default_workers() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert sources.default_workers() == 0


def test_script_checks_everything_before_writing(tmp_path, capsys, monkeypatch):
    data = make_image_folder(tmp_path / "data", classes=3)
    model = create_model("timm:resnet18", num_classes=5)
    torch.save(model.state_dict(), tmp_path / "r18_5.pth")
    out = tmp_path / "out"
    base = ["--model", "timm:resnet18", "--data", str(data), "--out", str(out), "--device", "cpu"]
    cases = [
        (["--checkpoint", str(tmp_path / "r18_5.pth")],
         "5-class head (fc.weight: (5, 512)) but --data (3 class folders"),
        (["--components", "0"], "components"),
        (["--data", str(tmp_path)], "train/ and val/"),
        (["--model", "timm:no_such_net"], "timm has no model 'no_such_net'"),
        (["--lr-schedule", "wiggly"], "wiggly"),
        (["--train-bn", "--batch-size", "8"], "global batch of 16 = --batch-size 8 per process × 2"),
    ]
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun; checked before any process group
    for extra, message in cases:
        with pytest.raises(SystemExit) as done:
            _script().main([*base, *extra])
        assert done.value.code == 2
        assert message in capsys.readouterr().err, extra
        assert not out.exists(), extra


def test_single_process_infers_classes_and_validates_once(tmp_path, monkeypatch):
    from bayesify.train import evaluate as evaluate_module

    data = make_image_folder(tmp_path / "data", classes=3, train=3, val=1)
    torch.manual_seed(0)
    torch.save(create_model("torchvision:resnet18", num_classes=3).state_dict(),
               tmp_path / "resnet18_3cls.pth")
    calls = []
    real = evaluate_module.evaluate_sharded

    def counted(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "evaluate_sharded", counted)
    script = _script()
    monkeypatch.setattr(script, "evaluate_sharded", counted)
    out = tmp_path / "out"
    (out / "posterior.incomplete").mkdir(parents=True)  # left by an interrupted run
    final = script.main(["--model", "torchvision:resnet18", "--checkpoint",
                         str(tmp_path / "resnet18_3cls.pth"), "--data", str(data),
                         "--image-size", "32", "--epochs", "1", "--batch-size", "4",
                         "--components", "2", "--predict-samples", "1", "--out", str(out),
                         "--no-progress", "--device", "cpu"])
    # the last epoch's validation is the final evaluation; the other call scores the
    # starting network (fit compares the result with it)
    assert calls.count("BayesianModel") == 1 and calls.count("ModelPredictor") == 1
    history = json.loads((out / "history.jsonl").read_text())
    images = history["images_per_second"] * history["seconds"]
    assert history["steps"] == 3 and images == pytest.approx(9)  # 9 images, nothing dropped
    assert final["n"] == 3 and final["members"] == 2 and final["nll"] == history["val_nll"]
    assert json.loads((out / "run.json").read_text())["classes"] == [
        "class0", "class1", "class2"]
    assert not (out / "posterior.incomplete").exists()


def test_script_runs_a_curvature_family_with_the_default_flags(tmp_path):
    """Laplace takes no lr/momentum/...: flags left at their defaults are not passed."""
    data = make_image_folder(tmp_path / "data", classes=3, train=3, val=1)
    final = _script().main(["--model", "torchvision:resnet18", "--data", str(data),
                            "--image-size", "32", "--batch-size", "4", "--method", "laplace",
                            "--targets", "last_layer", "--out", str(tmp_path / "out"),
                            "--no-progress", "--device", "cpu"])
    assert final["n"] == 3 and final["epistemic"] > 0


def test_script_runs_data_parallel_and_writes_outputs(tmp_path):
    import timm
    from test_ddp import torchrun

    data = make_image_folder(tmp_path / "data")
    torch.manual_seed(0)
    torch.save(timm.create_model("resnet18", num_classes=2).state_dict(), tmp_path / "r18.pth")
    out = tmp_path / "out"
    torchrun(SCRIPT, "--model", "timm:resnet18", "--checkpoint", str(tmp_path / "r18.pth"),
             "--data", str(data), "--image-size", "32", "--epochs", "1",
             "--batch-size", "2", "--workers", "0", "--components", "2",
             "--predict-samples", "1", "--lr", "0.2", "--base-lr", "1e-4",
             "--out", str(out), "--no-progress", "--device", "cpu")
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["world_size"] == 2
    assert history[0]["steps"] == 2  # 8 images / (2 per rank × 2 ranks)
    assert {"val_accuracy", "val_nll", "val_ece"} <= set(history[0])
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["n"] == 4 and final["members"] == 2
    assert final["nll"] == history[0]["val_nll"]  # validated once, at the last epoch
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["epoch0001-step00000002.ckpt"]
    from safetensors.torch import load_file

    posterior = load_file(str(out / "posterior.safetensors"))
    assert "conv1.mean" in posterior and posterior["conv1.mean"].shape == (2, 3)
    assert json.loads((out / "args.json").read_text())["model"] == "timm:resnet18"
