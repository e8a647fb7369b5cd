"""Datasets named on the command line (models: :mod:`bayesify.data.model_source`).

Data: ``digits`` (the embedded scikit-learn digits protocol: classes 0–4 in
distribution, 5–9 out of distribution) or an ImageFolder directory with
``train/`` and ``val/`` (and optionally ``test/``) subfolders, preprocessed the
way the model expects (timm ``resolve_model_data_config`` / ``create_transform``;
torchvision ``weights.transforms()``, or the standard ImageNet transforms
without weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bayesify.data.model_source import (  # noqa: F401  (re-exported for the CLI)
    DIGITS_CNN,
    create_model,
    load_checkpoint,
    model_transforms,
    parse_model_spec,
    read_state_dict,
    save_checkpoint,
)
from bayesify.errors import BayesifyError

DIGITS = "digits"


@dataclass
class DataBundle:
    """Train / val / test datasets (and OOD when the protocol has one)."""

    train: Dataset
    val: Dataset
    test: Dataset
    num_classes: int
    ood: Dataset | None = None
    class_names: list[str] = field(default_factory=list)

    def loaders(self, *, batch_size: int = 64, seed: int = 0, workers: int | None = 0,
                eval_batch_size: int | None = None) -> dict[str, DataLoader]:
        """Shuffled (seeded) train loader and ordered evaluation loaders.

        ``workers=None``: :func:`default_workers`. No batch is dropped.
        """
        workers = default_workers() if workers is None else int(workers)
        eval_bs = eval_batch_size or max(batch_size, 256)
        generator = torch.Generator().manual_seed(seed)
        out = {"train": DataLoader(self.train, batch_size=batch_size, shuffle=True,
                                   generator=generator, num_workers=workers)}
        for split in ("val", "test", "ood"):
            dataset = getattr(self, split)
            if dataset is not None:
                out[split] = DataLoader(dataset, batch_size=eval_bs, num_workers=workers)
        return out


# -- inference and checks shared by the CLI and the ImageNet script ----------------------
def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers(*, processes: int | None = None, cap: int = 8) -> int:
    """DataLoader workers per process from the CPUs available.

    ``processes``: processes sharing this machine (default: torchrun's
    ``LOCAL_WORLD_SIZE``, else 1). Each gets ``cpus // processes - 1`` workers
    (one CPU stays with the training loop), at most ``cap``; with fewer than 3
    CPUs per process, 0 (loading in the main process is faster than workers
    competing for the same cores).
    """
    processes = processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    per_process = available_cpus() // max(processes, 1)
    return 0 if per_process < 3 else min(cap, per_process - 1)


@dataclass(frozen=True)
class BatchPlan:
    """How a training set of ``n`` examples splits into global batches.

    ``batch_size`` is per process; the global batch is ``batch_size × world_size``.
    ``dropped`` examples are left out of every epoch (``drop_last``).
    """

    n: int
    batch_size: int
    world_size: int
    drop_last: bool
    batches: int
    dropped: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def describe(self) -> str:
        text = (f"{self.n} training images; batch {self.batch_size} per process × "
                f"{self.world_size} process(es) = global batch {self.global_batch}; "
                f"{self.batches} step(s) per epoch")
        if self.dropped:
            text += (f"; drop_last leaves out {self.dropped} image(s) per epoch (the last, "
                     "partial global batch: BatchNorm statistics are trained)")
        return text


def plan_batches(n: int, *, batch_size: int, world_size: int = 1,
                 bn_train: bool = False) -> BatchPlan:
    """Global batches of an epoch; refuses a plan that yields no training step.

    ``drop_last`` only where it is needed: when BatchNorm statistics are trained
    (a small last batch per process would normalise over a handful of rows, a
    single row is an error). Otherwise the last global batch is partial (padded
    across processes by ``bayesify.fit``) and nothing is dropped.
    """
    if batch_size < 1:
        raise BayesifyError(f"--batch-size must be >= 1, got {batch_size}")
    if n < 1:
        raise BayesifyError("the training split holds no images")
    global_batch = batch_size * world_size
    full, remainder = divmod(n, global_batch)
    drop_last = bn_train and remainder > 0
    batches = full + (0 if drop_last or remainder == 0 else 1)
    if batches == 0:
        largest = max(n // world_size, 1)
        raise BayesifyError(
            f"the training split has {n} images, fewer than one global batch of "
            f"{global_batch} = --batch-size {batch_size} per process × {world_size} "
            f"process(es); with trained BatchNorm the partial batch would be dropped and no "
            f"step would run. Use --batch-size {largest} or less, or fewer processes"
        )
    return BatchPlan(n=n, batch_size=batch_size, world_size=world_size, drop_last=drop_last,
                     batches=batches, dropped=remainder if drop_last else 0)


@dataclass(frozen=True)
class FolderLayout:
    """What an ImageFolder ``--data`` directory holds (checked without decoding images)."""

    root: Path
    classes: list[str]
    counts: dict[str, int]  # images per split

    def has(self, split: str) -> bool:
        return split in self.counts


def inspect_image_folder(data: str | os.PathLike, *, required: tuple[str, ...] = ("train", "val"),
                         optional: tuple[str, ...] = ("test",)) -> FolderLayout:
    """Check the layout of ``--data``: split folders, class folders, images, same classes."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    root = Path(data)
    if not root.is_dir():
        raise BayesifyError(f"--data {root} is not a directory; expected 'digits' or an "
                            "ImageFolder directory with train/ and val/ subfolders")
    classes: list[str] | None = None
    counts: dict[str, int] = {}
    for split in (*required, *optional):
        path = root / split
        if not path.is_dir():
            if split in required:
                raise BayesifyError(
                    f"--data {root}: expected {' and '.join(s + '/' for s in required)} "
                    f"subfolders (one folder per class inside each); {path} is missing")
            continue
        try:
            found, index = find_classes(str(path))
            samples = make_dataset(str(path), index, extensions=IMG_EXTENSIONS)
        except FileNotFoundError as err:
            raise BayesifyError(f"--data {root}: {split}/ is not a valid ImageFolder: "
                                f"{err}") from err
        if classes is None:
            classes = found
        elif found != classes:
            raise BayesifyError(f"--data {root}: {split}/ has classes {found} but "
                                f"{required[0]}/ has {classes}; every split needs the same "
                                "class folders")
        counts[split] = len(samples)
    return FolderLayout(root=root, classes=list(classes or []), counts=counts)


def data_classes(data: str) -> list[str]:
    """Class names of ``--data`` (digits: the in-distribution digits 0–4)."""
    if data == DIGITS:
        return [str(c) for c in range(5)]
    return inspect_image_folder(data).classes


def model_input(spec: str, data: str, image_size: int | None) -> tuple[int, int | None]:
    """``(in_channels, image_size)`` the model sees: digits-cnn on digits is 1×8×8."""
    source, _ = parse_model_spec(spec)
    if data == DIGITS:
        if source == DIGITS_CNN:
            return 1, image_size or 8
        return 3, image_size or 32
    return 3, image_size


def image_folder(root: str | os.PathLike, transform: Any = None) -> Dataset:
    """``torchvision.datasets.ImageFolder`` whose unreadable images are a
    :class:`BayesifyError` naming the file (PIL's "Truncated File Read" does not)."""
    from torchvision.datasets import ImageFolder

    class NamedImageFolder(ImageFolder):
        def __getitem__(self, index: int) -> Any:
            try:
                return super().__getitem__(index)
            except (OSError, ValueError, SyntaxError) as err:
                path = self.samples[index][0]
                raise BayesifyError(f"cannot read image {path} ({type(err).__name__}: {err}); "
                                    "the file is damaged or not an image: replace or remove "
                                    "it") from err

    return NamedImageFolder(str(root), transform=transform)


def build_data(data: str, model: nn.Module, spec: str, *, image_size: int | None = None,
               seed: int = 0, ood: str | os.PathLike | None = None) -> DataBundle:
    """Datasets of ``--data`` preprocessed for ``model`` (eval transforms; see module docstring)."""
    channels, size = model_input(spec, data, image_size)
    if data == DIGITS:
        from bayesify.data.digits import load_digits_splits

        splits = load_digits_splits(seed=seed, size=size or 8, channels=channels)
        return DataBundle(train=splits.train, val=splits.val, test=splits.test, ood=splits.ood,
                          num_classes=splits.num_classes, class_names=data_classes(data))
    layout = inspect_image_folder(data)
    _, transform = model_transforms(model, spec, image_size=size)
    root = layout.root
    train = image_folder(root / "train", transform)
    val = image_folder(root / "val", transform)
    test = image_folder(root / "test", transform) if layout.has("test") else val
    ood_set = image_folder(ood, transform) if ood is not None else None
    return DataBundle(train=train, val=val, test=test, ood=ood_set,
                      num_classes=len(train.classes), class_names=list(train.classes))
