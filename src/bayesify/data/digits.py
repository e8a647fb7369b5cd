"""scikit-learn's digits (real 8×8 handwritten digits, shipped with scikit-learn).

Protocol: classes 0–4 are in distribution (stratified train/val/test split with a
fixed seed), classes 5–9 are out of distribution. Optional resize to 3×32×32 for
timm/torchvision architectures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from bayesify.errors import BayesifyError


@dataclass
class DigitsSplits:
    """Tensor datasets of the digits protocol. Images ``[N, C, H, W]`` in [0, 1]."""

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    ood: TensorDataset
    num_classes: int
    in_classes: tuple[int, ...]

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.train.tensors[0].shape[1:])


def _images(data: np.ndarray, size: int, channels: int) -> torch.Tensor:
    x = torch.from_numpy(data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    if channels == 3:
        x = x.repeat(1, 3, 1, 1)
    elif channels != 1:
        raise BayesifyError(f"channels must be 1 or 3, got {channels}")
    return x.contiguous()


def load_digits_splits(
    *,
    seed: int = 0,
    size: int = 8,
    channels: int = 1,
    in_classes: tuple[int, ...] = (0, 1, 2, 3, 4),
    val_fraction: float = 0.15,
    test_fraction: float = 0.3,
    all_classes: bool = False,
) -> DigitsSplits:
    """Split digits into train/val/test (in distribution) and OOD (held-out classes).

    ``all_classes=True`` keeps all ten classes in distribution (no OOD split).
    Labels of in-distribution classes are re-indexed to ``0..len(in_classes)-1``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    data, target = digits.data, digits.target
    if all_classes:
        in_classes = tuple(range(10))
    mask = np.isin(target, in_classes)
    remap = {c: i for i, c in enumerate(in_classes)}
    x_in, y_in = data[mask], np.array([remap[t] for t in target[mask]])
    idx = np.arange(len(y_in))
    idx_trainval, idx_test = train_test_split(
        idx, test_size=test_fraction, stratify=y_in, random_state=seed
    )
    rel_val = val_fraction / (1.0 - test_fraction)
    idx_train, idx_val = train_test_split(
        idx_trainval, test_size=rel_val, stratify=y_in[idx_trainval], random_state=seed
    )

    def make(rows: np.ndarray, labels: np.ndarray) -> TensorDataset:
        return TensorDataset(_images(rows, size, channels), torch.from_numpy(labels).long())

    ood_rows = data[~mask]
    ood_labels = np.full(len(ood_rows), -1)
    return DigitsSplits(
        train=make(x_in[idx_train], y_in[idx_train]),
        val=make(x_in[idx_val], y_in[idx_val]),
        test=make(x_in[idx_test], y_in[idx_test]),
        ood=make(ood_rows, ood_labels) if len(ood_rows) else make(data[:0], target[:0]),
        num_classes=len(in_classes),
        in_classes=tuple(in_classes),
    )


def digits_loaders(
    splits: DigitsSplits, *, batch_size: int = 64, seed: int = 0, eval_batch_size: int = 512
) -> dict[str, DataLoader]:
    """Shuffled, seeded train loader; ordered evaluation loaders."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "train": DataLoader(splits.train, batch_size=batch_size, shuffle=True, generator=generator),
        "val": DataLoader(splits.val, batch_size=eval_batch_size),
        "test": DataLoader(splits.test, batch_size=eval_batch_size),
        "ood": DataLoader(splits.ood, batch_size=eval_batch_size),
    }
