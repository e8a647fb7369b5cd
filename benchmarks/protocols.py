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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import text_protocol
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
    #: the shifted test inputs by kind, where the protocol draws them itself (text)
    shifted: dict | None = None

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


#: feature width of protocol 3's CNN (``DigitsCNN(width=256)``: 512 features into the head,
#: as a real network has hundreds to thousands — ResNet-50 2048, ViT-B 768, MiniLM 384 —
#: against protocol 1's 64, which 200 fine-tuning images span completely)
WIDE_CNN_WIDTH = 256


def wide_pretrained(p: Protocol, seed: int, member: int = 0, epochs: int = 60) -> torch.nn.Module:
    """Protocol 3: protocol 1's data and training, a ``DigitsCNN`` of width 256 (512
    features into the classifier)."""
    torch.manual_seed(100 * seed + member)
    g = torch.Generator().manual_seed(100 * seed + member)
    loader = DataLoader(p.pre, batch_size=64, shuffle=True, generator=g)
    return train_map(DigitsCNN(p.num_classes, width=WIDE_CNN_WIDTH), loader, epochs=epochs,
                     seed=100 * seed + member, weight_decay=0.0).eval()


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


# -- protocol 2: a tiny ViT (LayerNorm) on other classes, other shifts, other OOD sets ------------
#
# * **data**: scikit-learn's digits, classes 2–9 in distribution (8 classes), pixel noise
#   σ = 0.1 and no translation (a ViT this small has no translation invariance: with the
#   1-pixel jitter of protocol 1 it stays near 50 %);
# * **pretrained network**: timm's ``VisionTransformer`` (8×8 input, 2×2 patches → 16 tokens,
#   width 32, 2 blocks of 2 heads, MLP ratio 2, LayerNorm, mean-pooled tokens, a Linear
#   head), 100 epochs of AdamW (lr 3e-3, weight decay 0.05) on the whole training split
#   (≈ 790 images): ≈ 91–93 % clean accuracy, ≈ 10 s on one thread;
# * fine-tuning (200 images), validation and test splits as in protocol 1;
# * **shifts** (none of protocol 1's, none the library synthesises): ``pixelate`` (2×2
#   blocks), ``brightness`` (+0.35), ``elastic`` (a smooth random displacement field, ±1 px),
#   ``shear`` (horizontal, 0.45), ``motion_blur`` (a 1×5 horizontal box), ``zoom_out``
#   (the image shrunk to 5/8 about its centre);
# * **OOD**: digits 0 and 1 (near) and synthetic strokes: random lines, boxes and rings
#   with noise (far).

VIT_IN_CLASSES = tuple(range(2, 10))
VIT_SEEN: tuple[str, ...] = ()
VIT_UNSEEN = ("pixelate", "brightness", "elastic", "shear", "motion_blur", "zoom_out")
VIT_CONFIG = {"img_size": 8, "patch_size": 2, "in_chans": 1, "embed_dim": 32, "depth": 2,
              "num_heads": 2, "mlp_ratio": 2.0, "global_pool": "avg"}


def _pixel_noise(ds: TensorDataset, seed: int, sigma: float = 0.1) -> TensorDataset:
    x, y = ds.tensors
    g = torch.Generator().manual_seed(seed)
    return TensorDataset((x + sigma * torch.randn(x.shape, generator=g)).clamp(0, 1.2), y)


def synthetic_strokes(n: int, seed: int, size: int = 8) -> torch.Tensor:
    """``[n, 1, size, size]`` far-OOD images: a random line, box outline or ring (one third
    each), intensity 0.6–1, plus pixel noise σ = 0.1."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32),
                            torch.arange(size, dtype=torch.float32), indexing="ij")
    out = torch.zeros(n, 1, size, size)
    for i in range(n):
        u = torch.rand(6, generator=g) * (size - 1)
        level = 0.6 + 0.4 * float(torch.rand((), generator=g))
        if i % 3 == 0:  # a thick line between two random points
            a, b = u[:2], u[2:4]
            d = b - a
            t = (((xx - a[0]) * d[0] + (yy - a[1]) * d[1]) / (d @ d + 1e-6)).clamp(0, 1)
            dist = ((xx - a[0] - t * d[0]) ** 2 + (yy - a[1] - t * d[1]) ** 2).sqrt()
            img = (dist < 0.9).float()
        elif i % 3 == 1:  # a box outline
            x0, x1 = sorted(u[:2].round().long().tolist())
            y0, y1 = sorted(u[2:4].round().long().tolist())
            x1, y1 = max(x1, x0 + 2), max(y1, y0 + 2)
            img = torch.zeros(size, size)
            img[y0:y1 + 1, [x0, min(x1, size - 1)]] = 1
            img[[y0, min(y1, size - 1)], x0:x1 + 1] = 1
        else:  # a ring
            cx, cy, r = u[0], u[1], 1.5 + float(u[2]) / (size - 1) * 2.0
            dist = ((xx - cx) ** 2 + (yy - cy) ** 2).sqrt()
            img = ((dist - r).abs() < 0.7).float()
        out[i, 0] = level * img
    return (out + 0.1 * torch.randn(out.shape, generator=g)).clamp(0, 1.2)


def vit_protocol(seed: int, n_train: int = 200) -> Protocol:
    sp = load_digits_splits(seed=seed, in_classes=VIT_IN_CLASSES)
    pre = _pixel_noise(sp.train, 110 + seed)
    return Protocol(pre=pre, train=_subset(pre, n_train, seed),
                    val=_pixel_noise(sp.val, 120 + seed), test=_pixel_noise(sp.test, 130 + seed),
                    ood_near=_pixel_noise(sp.ood, 140 + seed).tensors[0],
                    ood_far=synthetic_strokes(400, 150 + seed), num_classes=len(VIT_IN_CLASSES))


def tiny_vit(num_classes: int) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(num_classes=num_classes, **VIT_CONFIG)


def vit_pretrained(p: Protocol, seed: int, member: int = 0, epochs: int = 100) -> torch.nn.Module:
    """The tiny ViT trained on the whole training split (deep-ensemble members: other seeds)."""
    torch.manual_seed(100 * seed + member)
    model = tiny_vit(p.num_classes)
    g = torch.Generator().manual_seed(100 * seed + member)
    loader = DataLoader(p.pre, batch_size=64, shuffle=True, generator=g)
    return train_map(model, loader, epochs=epochs, seed=100 * seed + member,
                     weight_decay=0.05).eval()


def _warp(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return F.grid_sample(x, grid.to(x.dtype), mode="bilinear", padding_mode="zeros",
                         align_corners=False)


def _affine(x: torch.Tensor, matrix: list[list[float]]) -> torch.Tensor:
    theta = torch.tensor(matrix, dtype=x.dtype).expand(x.shape[0], 2, 3)
    return _warp(x, F.affine_grid(theta, list(x.shape), align_corners=False))


def _elastic(x: torch.Tensor, seed: int, pixels: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, _, h, w = x.shape
    coarse = torch.randn(n, 2, 3, 3, generator=g)
    field = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=True)
    field = field / field.abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(1e-6)
    base = F.affine_grid(torch.eye(2, 3).expand(n, 2, 3), [n, 1, h, w], align_corners=False)
    scale = torch.tensor([2.0 * pixels / w, 2.0 * pixels / h])
    return _warp(x, base + field.permute(0, 2, 3, 1) * scale)


def vit_shifts(x: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    c = x.shape[1]
    box = torch.full((c, 1, 1, 5), 1.0 / 5)
    return {
        "pixelate": F.interpolate(F.avg_pool2d(x, 2), scale_factor=2, mode="nearest"),
        "brightness": x + 0.35,
        "elastic": _elastic(x, seed),
        "shear": _affine(x, [[1.0, 0.45, 0.0], [0.0, 1.0, 0.0]]),
        "motion_blur": F.conv2d(x, box, padding=(0, 2), groups=c),
        "zoom_out": _affine(x, [[1.6, 0.0, 0.0], [0.0, 1.6, 0.0]]),
    }


def minilm_protocol(seed: int, n_train: int = 200) -> Protocol:
    d = text_protocol.text_data(seed, n_train)
    return Protocol(pre=d.pre, train=d.train, val=d.val, test=d.test, ood_near=d.ood_near,
                    ood_far=d.ood_far, num_classes=len(text_protocol.CLASSES), shifted=d.shifted)


def minilm_pretrained(p: Protocol, seed: int, member: int = 0, epochs: int = 4) -> torch.nn.Module:
    """The real MiniLM (2 blocks) + head, the whole network fine-tuned on the training split
    (deep-ensemble members: other seeds of the fine-tuning)."""
    torch.manual_seed(100 * seed + member)
    model = text_protocol.SentenceClassifier(p.num_classes)
    return text_protocol.fine_tune(model, p.pre, epochs=epochs, seed=100 * seed + member)


def _drawn(_x: torch.Tensor, _seed: int) -> dict[str, torch.Tensor]:
    raise AssertionError("the text protocol draws its shifted sets with its data")


def cached(train: Callable[..., torch.nn.Module], name: str) -> Callable[..., torch.nn.Module]:
    """``train`` with its networks kept in ``$BAYESIFY_BENCH_CACHE`` (a directory; unset: no
    cache) by protocol, seed, member and epochs — training is seeded, so a cached network is
    the one the call would train (the wide CNN takes ~8 min a network on one thread)."""
    def build(p: Protocol, seed: int, member: int = 0, epochs: int | None = None) -> torch.nn.Module:
        kwargs = {} if epochs is None else {"epochs": epochs}
        where = os.environ.get("BAYESIFY_BENCH_CACHE")
        if not where:
            return train(p, seed, member, **kwargs)
        path = os.path.join(where, f"{name}_s{seed}_m{member}_e{epochs}.pt")
        if os.path.exists(path):  # tensors only (weights_only): the untrained network + weights
            model = train(p, seed, member, epochs=0)
            model.load_state_dict(torch.load(path, weights_only=True))
            return model.eval()
        model = train(p, seed, member, **kwargs)
        os.makedirs(where, exist_ok=True)
        torch.save(model.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
        return model
    build.__wrapped__ = train  # the uncached trainer (timing a member afresh)
    return build


@dataclass(frozen=True)
class Spec:
    """One quality protocol: its data, its pretrained network, its shifts."""

    name: str
    description: str
    build: Callable[[int], Protocol]
    pretrained: Callable[..., torch.nn.Module]
    shifts: Callable[[torch.Tensor, int], dict[str, torch.Tensor]]
    seen: tuple[str, ...]
    unseen: tuple[str, ...]
    map_epochs: int
    quick_map_epochs: int

    def evaluation_sets(self, seed: int) -> tuple[Protocol, torch.Tensor, torch.Tensor,
                                                  dict[str, torch.Tensor], torch.Tensor]:
        """Seed ``seed``'s protocol (``torch.manual_seed(seed)`` first), its test inputs and
        labels, the shifted test inputs by kind and the OOD inputs (near + far)."""
        torch.manual_seed(seed)
        p = self.build(seed)
        tx, ty = p.test.tensors
        shifted = p.shifted if p.shifted is not None else self.shifts(tx, seed)
        return p, tx, ty, shifted, text_protocol.cat([p.ood_near, p.ood_far])


PROTOCOLS = {
    "digits-cnn": Spec("digits-cnn", "noisy digits, classes 0–7, pretrained CNN (BatchNorm), 200 "
                       "fine-tuning images; shifts *unseen* by the library: blur, contrast, "
                       "translate, occlude; *seen*: gaussian, salt-and-pepper, rotation; OOD: "
                       "digits 8–9 + photo patches", protocol, cached(pretrained, "digits-cnn"),
                       shifts, SEEN, UNSEEN,
                       60, 20),
    "digits-vit": Spec("digits-vit", "noisy digits, classes 2–9, pretrained tiny ViT (timm, "
                       "LayerNorm, mean-pooled tokens), 200 fine-tuning images; shifts, all "
                       "*unseen* by the library: pixelate, brightness, elastic, shear, motion "
                       "blur, zoom-out; OOD: digits 0–1 + synthetic strokes (lines, boxes, "
                       "rings)", vit_protocol, cached(vit_pretrained, "digits-vit"), vit_shifts,
                       VIT_SEEN, VIT_UNSEEN,
                       100, 40),
    "wide-cnn": Spec("wide-cnn", "protocol 1 (noisy digits 0–7, its shifts and OOD sets) with a "
                     "wide pretrained CNN: DigitsCNN(width=256), 512 features into the head — "
                     "more than the 200 fine-tuning images span, as in real networks",
                     protocol, cached(wide_pretrained, "wide-cnn"), shifts, SEEN, UNSEEN, 60, 20),
    "minilm-text": Spec("minilm-text", "template sentences of 6 topics, the real all-MiniLM-L6-v2 "
                        "(first 2 blocks, LayerNorm, masked mean pooling) fine-tuned whole on 900 "
                        "sentences, 200 fine-tuning sentences; shifts, all *unseen* by the "
                        "library: typos, dropped words, an appended clause of an unseen topic, "
                        "held-out paraphrases, shuffled words; OOD: 2 unseen topics + random word "
                        "pieces", minilm_protocol, cached(minilm_pretrained, "minilm-text"),
                        _drawn, text_protocol.TEXT_SEEN, text_protocol.TEXT_UNSEEN, 4, 2),
}
