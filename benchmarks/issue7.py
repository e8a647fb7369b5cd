"""Issue 7 figures: temperature scaling per family on digits, export agreement and throughput.

    python benchmarks/issue7.py --out benchmarks/results/issue7.json [--epochs N]

For every registered family: its defaults (MAP DigitsCNN on digits 0–4,
bayesify, fit), then val NLL / test NLL / test ECE before and after
``predictor.calibrate(val)``, and the max |Δ| of an exported ``.pt2`` against the
in-process predictor (or why the family cannot be exported). Then CPU throughput
of the exported module vs the in-process predictor (digits CNN and timm resnet18).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bayesify import bayesify, fit, list_methods
from bayesify.data.digits import digits_loaders, load_digits_splits
from bayesify.data.models import DigitsCNN, train_map
from bayesify.errors import BayesifyError
from bayesify.predict.predictor import ModelPredictor


def calibration_row(predictor, loaders) -> dict:
    val0, test0 = predictor.evaluate(loaders["val"]), predictor.evaluate(loaders["test"])
    result = predictor.calibrate(loaders["val"])
    test1 = predictor.evaluate(loaders["test"])
    return {"T": result.temperature, "val_nll_before": result.nll_before,
            "val_nll_after": result.nll_after, "test_nll_before": test0["nll"],
            "test_nll_after": test1["nll"], "test_ece_before": test0["ece"],
            "test_ece_after": test1["ece"], "val_ece_before": val0["ece"],
            "val_ece_after": result.ece_after}


def export_check(predictor, x: torch.Tensor, directory: Path, name: str) -> dict:
    try:
        info = predictor.export(directory / f"{name}.pt2", x)
        return {"export": "ok", "export_max_abs_diff": info["max_abs_diff"]}
    except BayesifyError as err:
        return {"export": f"refused: {err}"}


def throughput(predictor, path: Path, x: torch.Tensor, reps: int) -> dict:
    module = torch.export.load(str(path)).module()

    def in_process() -> tuple[torch.Tensor, torch.Tensor]:
        prediction = predictor(x)  # the same two outputs the exported module returns
        return prediction.probs, prediction.epistemic

    with torch.no_grad():
        module(x)
        in_process()  # warm-up
        start = time.perf_counter()
        for _ in range(reps):
            in_process()
        inproc = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(reps):
            module(x)
        exported = time.perf_counter() - start
    n = reps * x.shape[0]
    return {"in_process_img_s": n / inproc, "exported_img_s": n / exported,
            "ratio_exported_over_in_process": inproc / exported}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/issue7.json")
    parser.add_argument("--epochs", type=int, default=None, help="override the recipes' epochs")
    parser.add_argument("--methods", default=None, help="comma list (default: list_methods())")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-throughput", action="store_true", help="only the per-family table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    splits = load_digits_splits(seed=0)
    loaders = digits_loaders(splits, batch_size=64, seed=0)
    base = train_map(DigitsCNN(splits.num_classes), loaders["train"], epochs=40, seed=0)
    x_val = splits.val.tensors[0][:4]
    out: dict = {"methods": {}, "throughput": {}}
    tmp = Path(tempfile.mkdtemp())
    out["methods"]["map"] = calibration_row(ModelPredictor(base), loaders)
    methods = args.methods.split(",") if args.methods else list_methods()
    for name in methods:
        start = time.perf_counter()
        try:
            torch.manual_seed(0)
            bnn = bayesify(copy.deepcopy(base), name)  # the library defaults (no recipes)
            fit_kwargs: dict = {"val_loader": loaders["val"]}
            if args.epochs is not None and bnn.method.step().optimizes:
                fit_kwargs["epochs"] = args.epochs
            fit(bnn, loaders["train"], progress=False, **fit_kwargs)
            predictor = bnn.predictor()
            row = calibration_row(predictor, loaders)
            row.update(export_check(predictor, x_val, tmp, name))
        except Exception as err:  # noqa: BLE001 - record and go on with the next family
            row = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-800:]}
        row["seconds"] = time.perf_counter() - start
        out["methods"][name] = row
        print(name, {k: v for k, v in row.items() if k != "trace"}, flush=True)
        Path(args.out).write_text(json.dumps(out, indent=2))

    if args.no_throughput:
        return
    # throughput on CPU: digits CNN (iBNN recipe, M = 20) and timm resnet18 at 64×64 (M = 4)
    import timm

    torch.manual_seed(0)
    digits_pred = bayesify(copy.deepcopy(base), "ibnn", components=4).predictor(
        samples_per_component=5)
    digits_pred.export(tmp / "tp_digits.pt2", x_val)
    out["throughput"]["digits_cnn_ibnn_M20_B256"] = throughput(
        digits_pred, tmp / "tp_digits.pt2", splits.test.tensors[0][:256], args.reps)
    resnet = timm.create_model("resnet18", pretrained=False, num_classes=5).eval()
    resnet_pred = bayesify(resnet, "ibnn", components=4).predictor(samples_per_component=1)
    resnet_pred.export(tmp / "tp_resnet.pt2", torch.randn(2, 3, 64, 64))
    out["throughput"]["resnet18_ibnn_M4_B16_64px"] = throughput(
        resnet_pred, tmp / "tp_resnet.pt2", torch.randn(16, 3, 64, 64), args.reps)
    try:
        info = resnet_pred.export(tmp / "tp_resnet.onnx", torch.randn(2, 3, 64, 64), format="onnx")
        out["throughput"]["resnet18_onnx_max_abs_diff"] = info["max_abs_diff"]
    except Exception as err:  # noqa: BLE001
        out["throughput"]["resnet18_onnx_error"] = str(err)
    print(json.dumps(out["throughput"], indent=2))
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
