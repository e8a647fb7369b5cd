"""User intent: frozen parameters stay frozen, a re-run command resumes, damaged files are named."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit
from tests.test_imagenet_script import _script, make_image_folder

x_all = torch.randn(32, 6, generator=torch.Generator().manual_seed(0))
y_all = (x_all[:, 0] > 0).long()
LOADER = DataLoader(TensorDataset(x_all, y_all), batch_size=8)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_base_lr_trains_only_what_the_user_left_trainable():
    model = net()
    model[0].requires_grad_(False)  # frozen by the user on purpose
    bnn = bayesify(model, "ibnn", targets="last_layer")
    before = weights(bnn.unwrap())
    fit(bnn, LOADER, epochs=2, base_lr=0.1, progress=False)
    after = weights(bnn.unwrap())
    assert torch.equal(after["0.weight"], before["0.weight"])
    assert torch.equal(after["0.bias"], before["0.bias"])
    assert not torch.equal(after["2.weight"], before["2.weight"])  # left trainable: trained
    assert not torch.equal(after["4.weight"], before["4.weight"])
    assert not bnn.unwrap()[0].weight.requires_grad  # unwrap restores the user's flags


def test_base_lr_with_every_base_parameter_frozen_is_refused():
    model = net().requires_grad_(False)
    bnn = bayesify(model, "ibnn")
    with pytest.raises(BayesifyError, match="requires_grad=False"):
        fit(bnn, LOADER, base_lr=0.1, progress=False)


def test_the_imagenet_example_resumes_when_rerun_without_pretrained_weights(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=2, train=2, val=1)
    argv = ["--model", "torchvision:resnet18", "--data", str(data), "--image-size", "32",
            "--epochs", "1", "--batch-size", "4", "--components", "2", "--predict-samples", "1",
            "--out", str(tmp_path / "out"), "--no-progress", "--device", "cpu"]
    first = _script().main(argv)
    torch.manual_seed(123)  # another process state: the script must seed the model itself
    again = _script().main(argv)  # resumes the finished run from its checkpoint
    assert again["nll"] == pytest.approx(first["nll"])


def test_an_unreadable_image_is_named(tmp_path):
    from bayesify.data.sources import image_folder

    root = make_image_folder(tmp_path / "data", classes=2, train=2, val=1)
    damaged = root / "train" / "class1" / "1.jpg"
    damaged.write_bytes(damaged.read_bytes()[:200])  # truncated
    dataset = image_folder(root / "train")
    with pytest.raises(BayesifyError, match=r"cannot read image .*class1/1\.jpg"):
        for _ in DataLoader(dataset, batch_size=2, collate_fn=list):
            pass
