"""Every family with its defaults on architectures outside the stress matrix (issue 30's
"held-out networks of those kinds"): rows in the stress matrix's format, for
``benchmarks/stress_table.py``.

Networks (trained here on 600 three-channel digits at 32 px, a few minutes on one CPU
thread; validation 300, test 400 images of the same distribution):

* ``resnet18`` — torchvision's ResNet-18 (BatchNorm, residual, 11 M parameters), AdamW;
* ``vit`` — timm's ``VisionTransformer`` (patch 4, 4 blocks of width 96, LayerNorm, dropout
  0.1, stochastic depth 0.1 — random in train mode);
* ``convnext`` — torchvision's ConvNeXt as ``tests/stress_nets.py::convnext`` (now also in
  the stress matrix);
* ``effb0`` — torchvision's EfficientNet-B0 (squeeze-excitation, SiLU, BatchNorm,
  stochastic depth 0.2, dropout 0.2 before the head).

    OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py vit 0 cells.jsonl [family,family]
    NOVAL=1 ...   # also every family without val_loader
    python benchmarks/stress_table.py cells.jsonl
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from stress_nets import _train, convnext, image_loaders, rgb_digits
from test_defaults import base_metrics, bnn_metrics
from test_stress_pretrained import calibrated_nll, finite_posterior, held_out_reference

import bayesify


def resnet18(seed: int):
    import torchvision

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = torchvision.models.resnet18(num_classes=10)
    _train(model, d[0], d[1], steps=400, lr=1e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=True)


def vit(seed: int):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = VisionTransformer(img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3,
                              num_classes=10, drop_rate=0.1, drop_path_rate=0.1)
    _train(model, d[0], d[1], steps=800, lr=1e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *d, seed=seed)


def effb0(seed: int):
    import torchvision

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = torchvision.models.efficientnet_b0(num_classes=10, stochastic_depth_prob=0.2)
    _train(model, d[0], d[1], steps=600, lr=2e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=True)


NETS = {"resnet18": resnet18, "vit": vit, "effb0": effb0,
        "convnext": lambda seed: convnext(seed=seed, test=True)}


def main() -> None:
    net, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    families = sys.argv[4].split(",") if len(sys.argv) > 4 else bayesify.list_methods()
    uses = [True, False] if os.environ.get("NOVAL") else [True]
    began = time.perf_counter()
    model, train, val, test = NETS[net](seed)
    reference = held_out_reference(model, val, test)
    acc0, nll0, n = base_metrics(model, val)
    nll0_t = calibrated_nll(model, val)
    print(f"{net} built in {time.perf_counter() - began:.0f} s: validation accuracy {acc0:.4f}, "
          f"NLL {nll0:.4f} ({nll0_t:.4f} at its best temperature)", flush=True)
    for use_val in uses:
        for family in families:
            torch.manual_seed(seed)
            train.generator.manual_seed(seed)
            began = time.perf_counter()
            row = {"method": family, "net": net, "val": use_val, "seed": seed, "acc0": acc0,
                   "nll0": nll0, "nll0_t": nll0_t, "n": n, **reference}
            try:
                bnn = bayesify.bayesify(model, method=family)
                result = bayesify.fit(bnn, train, val_loader=val if use_val else None,
                                      progress=False, seed=seed)
                acc, nll, _ = bnn_metrics(bnn, val)
                test_acc, test_nll, _ = bnn_metrics(bnn, test)
                row.update(acc=acc, nll=nll, test_acc=test_acc, test_nll=test_nll,
                           finite=bool(finite_posterior(bnn)),
                           record={k: v for k, v in result.last.items()
                                   if isinstance(v, (int, float, str, bool)) or v is None})
            except Exception as err:  # noqa: BLE001 - a row says what failed
                row.update(error=f"{type(err).__name__}: {err}"[:500])
            row["seconds"] = time.perf_counter() - began
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(family, "val" if use_val else "no val",
                  {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()
                   if k in ("acc", "nll", "test_acc", "test_nll", "error", "seconds")}, flush=True)


if __name__ == "__main__":
    main()
