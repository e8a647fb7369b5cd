"""The ``bayesify`` console script: ``fit | evaluate | calibrate | export | demo | methods``.

Sub-commands register themselves in :data:`COMMANDS` as ``name → (help, add_arguments,
run)``; ``bayesify --help`` lists them and ``bayesify CMD --help`` explains every flag.

A run directory written by ``bayesify fit --out RUN`` holds everything the other
commands need: ``posterior.safetensors`` + ``bayesify.json`` (the posterior),
``base.safetensors`` (the base weights it was fitted on), ``run.json`` (model and
data), later ``calibration.json`` (the temperature). ``--posterior RUN`` then
fills in ``--model``, ``--data``, ``--checkpoint`` and ``--image-size``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bayesify.errors import BayesifyError
from bayesify.predict.predictor import BasePredictor

RUN_FILE = "run.json"
BASE_FILE = "base.safetensors"
CALIBRATION_FILE = "calibration.json"


# -- shared flags ------------------------------------------------------------------------
def _add_source_arguments(parser: argparse.ArgumentParser, *, posterior: bool) -> None:
    if posterior:
        parser.add_argument("--posterior", metavar="DIR", default=None,
                            help="run directory of `bayesify fit` (or any save_posterior "
                                 "directory); without it the plain base model (MAP) is used")
    parser.add_argument("--data", default=None,
                        help="'digits' (embedded scikit-learn digits: classes 0-4 in "
                             "distribution, 5-9 OOD) or an ImageFolder DIR with train/ and val/ "
                             "(and optional test/) subfolders (default: from --posterior, "
                             "else digits)")
    parser.add_argument("--model", default=None,
                        help="'digits-cnn', 'timm:NAME' (e.g. timm:resnet50) or "
                             "'torchvision:NAME' (default: from --posterior, else digits-cnn)")
    parser.add_argument("--checkpoint", metavar="PATH", default=None,
                        help="base weights: a state_dict as .safetensors or a torch file (read "
                             "with weights_only=True) (default: RUN/base.safetensors)")
    parser.add_argument("--pretrained", action="store_true",
                        help="start from the hub weights of the timm/torchvision model "
                             "(needs network access)")
    parser.add_argument("--map-epochs", type=int, default=None,
                        help="without --checkpoint/--pretrained, train the base model on the "
                             "train split for this many epochs first (default: 40 on digits, "
                             "0 = random init on folders)")
    parser.add_argument("--image-size", type=int, default=None,
                        help="input resolution (default: the model's own config; digits: 8 for "
                             "digits-cnn, 32 for timm/torchvision)")
    parser.add_argument("--ood", metavar="DIR", default=None,
                        help="ImageFolder of out-of-distribution images for OOD AUROC "
                             "(digits uses classes 5-9 automatically)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="training batch size; evaluation uses max(this, 256) (default: 64)")
    parser.add_argument("--workers", type=int, default=0,
                        help="DataLoader worker processes (default: 0)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data split, training and the predictive members' "
                             "noise (default: 0)")
    parser.add_argument("--device", default="auto",
                        help="'cpu', 'cuda', 'cuda:1', ... or 'auto' (cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    if posterior:
        parser.add_argument("--samples", type=int, default=None,
                            help="noise samples per component at prediction (M = K x samples; "
                                 "default: the family's predict_samples)")
        parser.add_argument("--temperature", type=float, default=None,
                            help="divide member logits by this (default: RUN/calibration.json "
                                 "when present, else 1)")


def _key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["k=v", ...]`` → dict; values parsed as JSON when possible (``4``, ``[1,2]``)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BayesifyError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BayesifyError(f"cannot read {path}: {err}") from err


def _resolve(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """``(base model on device, DataBundle, spec)`` from the flags and ``RUN/run.json``."""
    from bayesify.data import sources

    run_dir = Path(args.posterior) if getattr(args, "posterior", None) else None
    run = _read_json(run_dir / RUN_FILE) if run_dir and (run_dir / RUN_FILE).is_file() else {}
    spec = {
        "data": args.data or run.get("data") or sources.DIGITS,
        "model": args.model or run.get("model") or sources.DIGITS_CNN,
        "image_size": args.image_size or run.get("image_size"),
        "pretrained": bool(args.pretrained or run.get("pretrained", False)),
    }
    checkpoint = args.checkpoint
    if checkpoint is None and run_dir is not None and (run_dir / BASE_FILE).is_file():
        checkpoint = str(run_dir / BASE_FILE)
    classes = sources.data_classes(spec["data"])
    channels, _ = sources.model_input(spec["model"], spec["data"], spec["image_size"])
    torch.manual_seed(args.seed)
    model = sources.create_model(spec["model"], num_classes=len(classes), in_channels=channels,
                                 pretrained=spec["pretrained"], checkpoint=checkpoint)
    bundle = sources.build_data(spec["data"], model, spec["model"], image_size=spec["image_size"],
                                pretrained=spec["pretrained"], seed=args.seed, ood=args.ood)
    model.to(_device(args.device))
    map_epochs = args.map_epochs
    if map_epochs is None:
        map_epochs = 40 if spec["data"] == sources.DIGITS else 0
    if checkpoint is None and not spec["pretrained"]:
        if map_epochs > 0:
            from bayesify.data.models import train_map

            loader = bundle.loaders(batch_size=args.batch_size, seed=args.seed,
                                    workers=args.workers)["train"]
            train_map(model, _OnDevice(loader, model), epochs=map_epochs, seed=args.seed,
                      progress=not args.no_progress)
        else:
            print("bayesify: warning: no --checkpoint or --pretrained; the base model is "
                  "randomly initialised", file=sys.stderr)
    spec["checkpoint"] = checkpoint
    spec["classes"] = bundle.class_names
    return model.eval(), bundle, spec


class _OnDevice:
    """A loader whose batches are moved to a model's device (for ``train_map``)."""

    def __init__(self, loader: Any, model: Any) -> None:
        self.loader, self.model = loader, model

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        device = next(self.model.parameters()).device
        for x, y in self.loader:
            yield x.to(device), y.to(device)


def _predictor(args: argparse.Namespace, model: Any) -> Any:
    """The posterior predictor of ``--posterior`` (or MAP) with its temperature."""
    from bayesify.persistence import load_posterior
    from bayesify.predict.predictor import ModelPredictor

    if args.posterior is None:
        predictor = ModelPredictor(model)
    else:
        bnn = load_posterior(model, args.posterior)
        predictor = bnn.predictor(args.samples, seed=args.seed)
    calibration = Path(args.posterior or ".") / CALIBRATION_FILE
    if args.temperature is not None:
        predictor.temperature = float(args.temperature)
    elif args.posterior is not None and calibration.is_file():
        predictor.temperature = float(_read_json(calibration)["temperature"])
    return predictor


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def _format_metrics(metrics: dict[str, Any]) -> str:
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in metrics.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


# -- fit ------------------------------------------------------------------------------------
def _add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    _add_source_arguments(parser, posterior=False)
    parser.add_argument("--method", default="ibnn",
                        help="posterior family (see `bayesify methods`; default: ibnn)")
    parser.add_argument("--option", action="append", metavar="KEY=VALUE",
                        help="a config field of the family, repeatable, value parsed as JSON: "
                             "--option components=4 --option targets=last_layer")
    parser.add_argument("--recipe", action="store_true",
                        help="start from the family's digits demo recipe (options, epochs, KL "
                             "anneal); explicit flags override it")
    parser.add_argument("--epochs", type=int, default=None,
                        help="posterior fine-tuning epochs (default: 5, or the recipe's)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate of the posterior (default: the family's)")
    parser.add_argument("--base-lr", type=float, default=0.0,
                        help="learning rate of the base weights; 0 keeps them frozen (default)")
    parser.add_argument("--kl-anneal-epochs", type=float, default=None,
                        help="anneal the KL weight linearly 0 -> 1 over this many epochs "
                             "(default: 0 = no annealing, or the recipe's)")
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd",
                        help="optimiser of the posterior (default: sgd, Nesterov 0.9)")
    parser.add_argument("--fit-option", action="append", metavar="KEY=VALUE",
                        help="extra keyword for bayesify.fit / a post-hoc family's fit "
                             "(repeatable, JSON values)")
    parser.add_argument("--out", default="bayesify-run",
                        help="run directory: posterior, base weights, run.json, history "
                             "(default: %(default)s)")


def _run_fit(args: argparse.Namespace) -> int:
    from bayesify.core.factory import bayesify
    from bayesify.core.registry import get_method_class
    from bayesify.data.sources import save_checkpoint
    from bayesify.train.loop import fit

    recipe = get_method_class(args.method).demo_recipe() if args.recipe else {}
    options = {**recipe.get("options", {}), **_key_values(args.option, "--option")}
    fit_kwargs = {"epochs": 5, **recipe.get("fit", {})}
    for key, value in (("epochs", args.epochs), ("lr", args.lr),
                       ("kl_anneal_epochs", args.kl_anneal_epochs)):
        if value is not None:
            fit_kwargs[key] = value
    fit_kwargs.update(_key_values(args.fit_option, "--fit-option"))
    model, bundle, spec = _resolve(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, out / BASE_FILE)
    loaders = bundle.loaders(batch_size=args.batch_size, seed=args.seed, workers=args.workers)
    # recipes name loaders by split ("val_loader": "val")
    fit_kwargs = {k: loaders.get(v, v) if isinstance(v, str) and k.endswith("_loader") else v
                  for k, v in fit_kwargs.items()}
    bnn = bayesify(model, args.method, **options)
    gradient = bnn.method.gradient_trained
    extra = ({"base_lr": args.base_lr, "optimizer": args.optimizer, "log_dir": out}
             if gradient else {})
    result = fit(bnn, loaders["train"], progress=not args.no_progress, **extra, **fit_kwargs)
    bnn.save_posterior(out)
    predictor = bnn.predictor(seed=args.seed)
    val = predictor.evaluate(loaders["val"])
    _write_json(out / RUN_FILE, {
        "data": spec["data"], "model": spec["model"], "image_size": spec["image_size"],
        "pretrained": spec["pretrained"], "classes": spec["classes"], "method": args.method,
        "options": options, "seed": args.seed,
        "fit": {k: v for k, v in fit_kwargs.items() if not k.endswith("_loader")},
        "history": result.history, "val": val,
    })
    print(bnn.summary())
    print("\nvalidation:\n" + _format_metrics(val))
    print(f"\nwrote {out}/ (posterior.safetensors, bayesify.json, {BASE_FILE}, {RUN_FILE})")
    return 0


# -- evaluate -------------------------------------------------------------------------------
def _add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    _add_source_arguments(parser, posterior=True)
    parser.add_argument("--split", choices=("val", "test"), default="test",
                        help="split to evaluate (folders without test/ use val/; default: test)")
    parser.add_argument("--out", default=None,
                        help="directory for metrics.json, reliability.png, entropy_hist.png "
                             "(default: RUN/evaluate, or bayesify-eval)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG figures")


def _run_evaluate(args: argparse.Namespace) -> int:
    from bayesify import metrics
    from bayesify.core.prediction import Prediction

    model, bundle, spec = _resolve(args)
    predictor = _predictor(args, model)
    loaders = bundle.loaders(batch_size=args.batch_size, seed=args.seed, workers=args.workers)
    # one pass over the data: metrics and figures both read the collected member logits
    logits, labels = predictor.collect(loaders[args.split])
    ood_logits = predictor.collect(loaders["ood"])[0] if "ood" in loaders else None
    replay = _Replay(logits if ood_logits is None else torch.cat([logits, ood_logits], dim=1),
                     predictor.temperature)
    n = logits.shape[1]
    result = replay.evaluate(replay.loader(0, n, labels),
                             None if ood_logits is None else replay.loader(n, ood_logits.shape[1]))
    result.update({"split": args.split, "temperature": predictor.temperature,
                   "method": getattr(getattr(predictor, "bnn", None), "method_name", "map"),
                   "model": spec["model"], "data": spec["data"]})
    out = Path(args.out or (Path(args.posterior) / "evaluate" if args.posterior
                            else "bayesify-eval"))
    _write_json(out / "metrics.json", result)
    print(_format_metrics(result))
    if not args.no_plots:
        pred = Prediction(logits / predictor.temperature)
        conf, guess = pred.probs.max(-1)
        metrics.save_reliability_diagram({result["method"]: (conf, (guess == labels).float())},
                                         out / "reliability.png")
        groups = {f"{args.split} (in distribution)": pred.entropy}
        if ood_logits is not None:
            groups["OOD"] = Prediction(ood_logits / predictor.temperature).entropy
        metrics.save_entropy_histogram({result["method"]: groups}, out / "entropy_hist.png",
                                       bundle.num_classes)
    print(f"\nwrote {out}/metrics.json" + ("" if args.no_plots else
          f", {out}/reliability.png, {out}/entropy_hist.png"))
    return 0


class _Replay(BasePredictor):
    """Member logits ``[M, N, C]`` computed once; a "batch" is an index tensor into N.

    Lets ``evaluate`` and the figures share one pass of the network over the data.
    """

    def __init__(self, logits: torch.Tensor, temperature: float) -> None:
        self.logits, self.temperature = logits, float(temperature)

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def member_logits(self, index: torch.Tensor) -> torch.Tensor:
        return self.logits[:, index]

    def loader(self, start: int, count: int, labels: torch.Tensor | None = None,
               chunk: int = 4096) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(torch.arange(start + i, start + min(i + chunk, count)),
                 None if labels is None else labels[i:i + chunk])
                for i in range(0, count, chunk)]


# -- calibrate ------------------------------------------------------------------------------
def _add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    _add_source_arguments(parser, posterior=True)
    parser.add_argument("--method", dest="calibration", choices=("temperature",),
                        default="temperature", help="calibration method (default: temperature)")
    parser.add_argument("--out", default=None,
                        help="directory for calibration.json and calibration_reliability.png "
                             "(default: the --posterior directory, so evaluate/export use it)")


def _run_calibrate(args: argparse.Namespace) -> int:
    from bayesify.predict.calibration import calibration_stats

    model, bundle, _ = _resolve(args)
    args.temperature = 1.0 if args.temperature is None else args.temperature
    predictor = _predictor(args, model)
    loaders = bundle.loaders(batch_size=args.batch_size, seed=args.seed, workers=args.workers)
    out = Path(args.out or args.posterior or "bayesify-calibration")
    out.mkdir(parents=True, exist_ok=True)
    result = predictor.calibrate(loaders["val"], method=args.calibration,
                                 plot=out / "calibration_reliability.png")
    test_logits, test_labels = predictor.collect(loaders["test"])
    payload = result.to_dict()
    for tag, temp in (("before", result.previous_temperature), ("after", result.temperature)):
        nll, ece, _, _ = calibration_stats(test_logits, test_labels, temp)
        payload[f"test_nll_{tag}"], payload[f"test_ece_{tag}"] = nll, ece
    _write_json(out / CALIBRATION_FILE, payload)
    print(_format_metrics(payload))
    print(f"\nwrote {out}/{CALIBRATION_FILE}, {result.plot}")
    return 0


# -- export ---------------------------------------------------------------------------------
def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    _add_source_arguments(parser, posterior=True)
    parser.add_argument("--format", choices=("pt2", "onnx"), default=None,
                        help="torch.export program (.pt2) or ONNX (default: from the --output "
                             "suffix, else pt2)")
    parser.add_argument("--output", default=None,
                        help="file to write (default: RUN/predictor.pt2 or .onnx)")
    parser.add_argument("--example-batch", type=int, default=2,
                        help="rows of the validation split used as the example input; the "
                             "batch axis of the export stays dynamic (default: 2)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip reloading the export and comparing it with the in-process "
                             "predictor")


def _run_export(args: argparse.Namespace) -> int:
    model, bundle, _ = _resolve(args)
    predictor = _predictor(args, model)
    fmt = args.format or ("onnx" if str(args.output or "").endswith(".onnx") else "pt2")
    output = Path(args.output or Path(args.posterior or ".") / f"predictor.{fmt}")
    rows = [bundle.val[i][0] for i in range(min(args.example_batch, len(bundle.val)))]
    info = predictor.export(output, torch.stack(rows), format=fmt, verify=not args.no_verify)
    print(_format_metrics(info))
    return 0


# -- demo / methods -------------------------------------------------------------------------
def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bayesify-demo",
                        help="output directory for results.json and the PNG figures "
                             "(default: %(default)s)")
    parser.add_argument("--methods", default="ibnn",
                        help="comma-separated posterior families to compare with MAP, e.g. "
                             "'ibnn,rank1,dropout' (default: %(default)s; see `bayesify methods`)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data split, MAP training and posterior (default: 0)")
    parser.add_argument("--map-epochs", type=int, default=40,
                        help="epochs of plain MAP training of the 'pretrained' CNN (default: 40)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="posterior fine-tuning epochs (default: each family's demo recipe)")
    parser.add_argument("--no-progress", action="store_true", help="hide tqdm progress bars")
    parser.add_argument("--no-plots", action="store_true",
                        help="skip the reliability diagram and entropy histogram PNGs")


def _run_demo(args: argparse.Namespace) -> int:
    from bayesify.demo import format_table, run_demo

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    results = run_demo(out_dir=args.out, methods=methods, seed=args.seed,
                       map_epochs=args.map_epochs, epochs=args.epochs,
                       progress=not args.no_progress, plots=not args.no_plots)
    print(format_table(results))
    print(f"\nwrote {args.out}/results.json" + ("" if args.no_plots else
          f", {args.out}/reliability.png, {args.out}/entropy_hist.png"))
    return 0


def _add_methods_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="show the options of this family")


def _run_methods(args: argparse.Namespace) -> int:
    from bayesify import describe_method, list_methods

    if args.name is None:
        print("\n".join(list_methods()))
        return 0
    for name, default, help_text in describe_method(args.name):
        print(f"{name} (default {default!r}): {help_text}")
    return 0


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {
    "fit": ("bayesify a model, fine-tune its posterior, save it with the base weights",
            _add_fit_arguments, _run_fit),
    "evaluate": ("accuracy, NLL, ECE, Brier, OOD AUROC of a posterior (or MAP); JSON + PNGs",
                 _add_evaluate_arguments, _run_evaluate),
    "calibrate": ("fit a temperature on the validation split (never raises its NLL)",
                  _add_calibrate_arguments, _run_calibrate),
    "export": ("freeze a posterior predictor into a .pt2 / ONNX file that needs only torch",
               _add_export_arguments, _run_export),
    "demo": ("train a CNN on digits 0–4, bayesify it, compare MAP vs posteriors",
             _add_demo_arguments, _run_demo),
    "methods": ("list the posterior families, or the options of one", _add_methods_arguments,
                _run_methods),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bayesify",
        description="Turn a pretrained PyTorch network into a Bayesian one: fit, evaluate, "
                    "calibrate and export posteriors.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except BayesifyError as err:
        print(f"bayesify: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
