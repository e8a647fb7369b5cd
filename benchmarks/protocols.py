"""The quality protocol of ``benchmarks/quality.py``: noisy digits, a pretrained CNN, a small
fine-tuning set, shifts the library synthesises and shifts it does not, near and far OOD.

Per seed (everything generated, no download):

* **data**: scikit-learn's digits, classes 0–7 in distribution; every image gets a fixed
  random 1-pixel translation and pixel noise (σ = 0.15), so the task is not saturated
  (the pretrained network reaches ≈ 96 %);
* **pretrained network**: a ``DigitsCNN`` trained on the whole training split (≈ 790
  images, 60 epochs, AdamW) — the network a user starts from;
* **fine-tuning set**: 200 images of that split (25 per class): what every posterior family
  and peer is fitted on; validation (≈ 220) and test (≈ 430) splits are separate;
* **shifts of the test split**: ``gaussian`` (x̂ = 0.6·x + 0.4·ε), ``salt_pepper`` (p = 0.2),
  ``rotation`` (45°) — kinds the library's evaluation module knows — and ``blur`` (two
  3×3 binomial passes), ``contrast`` (×0.3 around the image mean), ``translate`` (2 px),
  ``occlude`` (a random half-size square set to 0) — kinds the library neither synthesises
  nor uses in its validation search;
* **OOD**: digits 8 and 9 (near) and 8×8 patches of scikit-learn's two sample photographs
  (far).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from bayesify.data.digits import load_digits_splits
from bayesify.data.models import DigitsCNN, train_map
from bayesify.evaluation.corruptions import gaussian_mix, rotate, salt_and_pepper

IN_CLASSES = tuple(range(8))
SEEN = ("gaussian", "salt_pepper", "rotation")
UNSEEN = ("blur", "contrast", "translate", "occlude")


@dataclass
class Protocol:
    pre: TensorDataset
    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    ood_near: torch.Tensor
    ood_far: torch.Tensor
    num_classes: int

    def loaders(self, seed: int, batch_size: int = 32) -> dict[str, DataLoader]:
        g = torch.Generator().manual_seed(seed)
        return {"train": DataLoader(self.train, batch_size=batch_size, shuffle=True, generator=g),
                "val": DataLoader(self.val, batch_size=256),
                "test": DataLoader(self.test, batch_size=256)}


def _noisy(ds: TensorDataset, seed: int, sigma: float = 0.15) -> TensorDataset:
    x, y = ds.tensors
    g = torch.Generator().manual_seed(seed)
    dx = torch.randint(-1, 2, (x.shape[0], 2), generator=g)
    x = torch.stack([torch.roll(xi, tuple(d.tolist()), dims=(1, 2)) for xi, d in zip(x, dx)])
    return TensorDataset((x + sigma * torch.randn(x.shape, generator=g)).clamp(0, 1.2), y)


def _subset(ds: TensorDataset, n: int, seed: int) -> TensorDataset:
    x, y = ds.tensors
    rng = np.random.RandomState(seed)
    classes = y.unique().tolist()
    idx = []
    for c in classes:
        where = np.where(y.numpy() == c)[0]
        idx += list(rng.choice(where, size=min(n // len(classes), len(where)), replace=False))
    idx = torch.tensor(sorted(idx))
    return TensorDataset(x[idx], y[idx])


def far_ood(n: int, seed: int, size: int = 8) -> torch.Tensor:
    """``[n, 1, size, size]`` grey patches of scikit-learn's two sample photographs."""
    from sklearn.datasets import load_sample_images

    images = [torch.from_numpy(np.array(im, dtype=np.float32)).mean(-1) / 255.0
              for im in load_sample_images().images]
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        im = images[i % len(images)]
        s = int(torch.randint(16, 64, (), generator=g))
        top = int(torch.randint(0, im.shape[0] - s, (), generator=g))
        left = int(torch.randint(0, im.shape[1] - s, (), generator=g))
        patch = im[top:top + s, left:left + s][None, None]
        out.append(F.interpolate(patch, size=(size, size), mode="area")[0])
    return torch.stack(out)


def protocol(seed: int, n_train: int = 200) -> Protocol:
    sp = load_digits_splits(seed=seed, in_classes=IN_CLASSES)
    pre = _noisy(sp.train, 10 + seed)
    return Protocol(pre=pre, train=_subset(pre, n_train, seed), val=_noisy(sp.val, 20 + seed),
                    test=_noisy(sp.test, 30 + seed), ood_near=_noisy(sp.ood, 40 + seed).tensors[0],
                    ood_far=far_ood(400, seed), num_classes=len(IN_CLASSES))


def pretrained(p: Protocol, seed: int, member: int = 0, epochs: int = 60) -> torch.nn.Module:
    """A ``DigitsCNN`` trained on the whole training split (the deep ensemble's members are
    this with other seeds)."""
    torch.manual_seed(100 * seed + member)
    g = torch.Generator().manual_seed(100 * seed + member)
    loader = DataLoader(p.pre, batch_size=64, shuffle=True, generator=g)
    return train_map(DigitsCNN(p.num_classes), loader, epochs=epochs, seed=100 * seed + member,
                     weight_decay=0.0).eval()


def _blur(x: torch.Tensor) -> torch.Tensor:
    k = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16
    c = x.shape[1]
    for _ in range(2):
        x = F.conv2d(x, k.expand(c, 1, 3, 3).contiguous(), padding=1, groups=c)
    return x


def _occlude(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out, size = x.clone(), x.shape[-1] // 2
    for i in range(x.shape[0]):
        a, b = torch.randint(0, x.shape[-1] - size + 1, (2,), generator=g).tolist()
        out[i, :, a:a + size, b:b + size] = 0
    return out


def shifts(x: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return {
        "gaussian": gaussian_mix(x, 0.4, seed=seed),
        "salt_pepper": salt_and_pepper(x, 0.2, seed=seed),
        "rotation": rotate(x, 45.0),
        "blur": _blur(x),
        "contrast": (x - mean) * 0.3 + mean,
        "translate": torch.roll(x, shifts=(2, 2), dims=(2, 3)),
        "occlude": _occlude(x, seed),
    }


def threads() -> int:
    return int(os.environ.get("BAYESIFY_BENCH_THREADS", "1"))
