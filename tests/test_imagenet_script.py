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
from bayesify.train.imagenet import (
    build_transforms,
    load_model,
    method_options,
    parse_model_spec,
    read_state_dict,
)

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


def test_help_explains_every_flag():
    parser = _script().build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 8, action.option_strings
    text = parser.format_help()
    for flag in ("--model", "--pretrained", "--checkpoint", "--data", "--method", "--components",
                 "--prior-std", "--lr-schedule", "--base-lr", "--batch-size", "--workers",
                 "--resume", "--amp", "--channels-last", "--compile", "--grad-accum-steps"):
        assert flag in text


def test_method_flags_become_typed_config_options():
    parser = _script().build_parser()
    args = parser.parse_args(["--model", "timm:resnet18", "--data", "d", "--out", "o",
                              "--components", "8", "--prior-std", "0.1", "--init-std", "0.05",
                              "0.02", "--no-learn-std"])
    opts = method_options(args, "ibnn")
    assert opts == {"components": 8, "prior_std": 0.1, "init_std": (0.05, 0.02),
                    "learn_std": False}
    args = parser.parse_args(["--model", "timm:resnet18", "--data", "d", "--out", "o",
                              "--p", "0.2"])
    with pytest.raises(BayesifyError, match="does not apply to method 'ibnn'"):
        method_options(args, "ibnn")


def test_model_loading_and_preprocessing(tmp_path):
    with pytest.raises(BayesifyError, match="SOURCE:NAME"):
        parse_model_spec("resnet50")
    model, info = load_model("timm:resnet18", num_classes=3)
    state = {f"module.{k}": v for k, v in model.state_dict().items()}  # DDP-style prefix
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "ck.pth")
    assert read_state_dict(tmp_path / "ck.pth").keys() == model.state_dict().keys()
    again, _ = load_model("timm:resnet18", num_classes=3, checkpoint=tmp_path / "ck.pth")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values()))
    with pytest.raises(BayesifyError, match="do not fit"):
        load_model("timm:resnet18", num_classes=5, checkpoint=tmp_path / "ck.pth")
    from PIL import Image

    img = Image.new("RGB", (40, 40), (128, 10, 200))
    train_tf, eval_tf = build_transforms(model, info, image_size=32)
    assert eval_tf(img).shape == (3, 32, 32) and train_tf(img).shape == (3, 32, 32)
    tv_model, tv_info = load_model("torchvision:resnet18")
    _, tv_eval = build_transforms(tv_model, tv_info)  # weights.transforms(), no download
    assert tv_eval(img).shape == (3, 224, 224)


def test_script_runs_data_parallel_and_writes_outputs(tmp_path):
    import timm
    from test_ddp import torchrun

    data = make_image_folder(tmp_path / "data")
    torch.manual_seed(0)
    torch.save(timm.create_model("resnet18", num_classes=2).state_dict(), tmp_path / "r18.pth")
    out = tmp_path / "out"
    torchrun(SCRIPT, "--model", "timm:resnet18", "--checkpoint", str(tmp_path / "r18.pth"),
             "--num-classes", "2", "--data", str(data), "--image-size", "32", "--epochs", "1",
             "--batch-size", "2", "--workers", "0", "--components", "2",
             "--predict-samples", "1", "--lr", "0.2", "--base-lr", "1e-4",
             "--out", str(out), "--no-progress", "--device", "cpu")
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["world_size"] == 2
    assert history[0]["steps"] == 2  # 8 images / (2 per rank × 2 ranks)
    assert {"val_accuracy", "val_nll", "val_ece"} <= set(history[0])
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["n"] == 4 and final["members"] == 2
    assert final["nll"] == pytest.approx(history[0]["val_nll"], rel=1e-5)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["epoch0001-step00000002.ckpt"]
    from safetensors.torch import load_file

    posterior = load_file(str(out / "posterior" / "posterior.safetensors"))
    assert "conv1.mean" in posterior and posterior["conv1.mean"].shape == (2, 3)
    assert json.loads((out / "args.json").read_text())["model"] == "timm:resnet18"
