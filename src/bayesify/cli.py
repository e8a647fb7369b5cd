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
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bayesify import plots
from bayesify.cli_inputs import (
    BASE_FILE,
    CALIBRATION_FILE,
    RUN_FILE,
    StagedOutput,
    add_source_arguments,
    check_out,
    format_metrics,
    is_main,
    key_values,
    load_predictor,
    resolve,
    show_progress,
    write_json,
)
from bayesify.core.prediction import Prediction
from bayesify.errors import BayesifyError
from bayesify.predict.predictor import BasePredictor
from bayesify.train.loop import EPOCHS_HELP


# -- fit ------------------------------------------------------------------------------------
def _add_fit_arguments(parser: argparse.ArgumentParser, *, method: str = "ibnn",
                       show_family: bool = True) -> None:
    from bayesify.core.registry import list_methods
    from bayesify.train.imagenet import add_family_options

    add_source_arguments(parser, posterior=False)
    parser.add_argument("--method", default="ibnn", choices=list_methods(),
                        help="posterior family (default: ibnn); `bayesify fit --method NAME "
                             "--help` lists its options")
    parser.add_argument("--option", action="append", metavar="KEY=VALUE",
                        help="a config field of the family as KEY=VALUE (JSON value), "
                             "repeatable; the same as the family's own flags listed under "
                             "--method NAME --help")
    parser.add_argument("--epochs", type=int, default=None, help=EPOCHS_HELP)
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate of the posterior (default: the family's)")
    parser.add_argument("--base-lr", type=float, default=0.0,
                        help="learning rate of the base weights; 0 keeps them frozen (default)")
    parser.add_argument("--kl-anneal-epochs", type=float, default=None,
                        help="anneal the KL weight linearly 0 -> 1 over this many epochs "
                             "(default: 0 = no annealing)")
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=None,
                        help="optimiser of the posterior (default: the family's; SGD Nesterov "
                             "0.9 for most)")
    parser.add_argument("--fit-option", action="append", metavar="KEY=VALUE",
                        help="extra keyword for bayesify.fit / a post-hoc family's fit "
                             "(repeatable, JSON values)")
    parser.add_argument("--out", default="bayesify-run",
                        help="run directory: posterior, base weights, run.json, history; "
                             "written via OUT.incomplete/, moved in when the run succeeds "
                             "(default: %(default)s)")
    add_family_options(parser, method, show=show_family)
    parser.epilog = families_epilog()


def families_epilog() -> str:
    from bayesify.train.imagenet import families_epilog as epilog

    return epilog("bayesify fit")


def _fit_plan(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config options, fit keywords)``, all checked before any work."""
    import inspect

    from bayesify.core.registry import get_method_class
    from bayesify.train.imagenet import check_family_options, family_options
    from bayesify.train.loop import fit

    cls = get_method_class(args.method)
    options = {**key_values(args.option, "--option"),
               **family_options(args, args.method)}
    step = cls(check_family_options(args.method, options)).step()
    fit_kwargs: dict[str, Any] = {}  # epochs None: fit's step budget
    for key, value in (("epochs", args.epochs), ("lr", args.lr),
                       ("kl_anneal_epochs", args.kl_anneal_epochs)):
        if value is not None:
            fit_kwargs[key] = value
    fit_kwargs.update(key_values(args.fit_option, "--fit-option"))
    if fit_kwargs.get("epochs", 1) < 1:
        raise BayesifyError(f"--epochs must be >= 1, got {fit_kwargs['epochs']}")
    known = {n for n, p in inspect.signature(fit).parameters.items() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(fit_kwargs) - known)
    if unknown:
        raise BayesifyError(f"unknown fit option(s) {unknown} for method {args.method!r}; "
                            f"known: {sorted(known)}")
    refused = sorted(set(fit_kwargs) & set(step.refused))
    if refused:
        raise BayesifyError(f"method {args.method!r} cannot honour fit option(s) {refused}: "
                            f"{step.refusal}")
    check_out(Path(args.out))
    return options, fit_kwargs


def _run_fit(args: argparse.Namespace) -> int:
    from bayesify.core.factory import bayesify
    from bayesify.data.sources import save_checkpoint
    from bayesify.train.imagenet import RUN_PATHS, portable_path

    options, fit_kwargs = _fit_plan(args)
    model, bundle, spec = resolve(args)
    loaders = bundle.loaders(batch_size=args.batch_size, seed=args.seed, workers=args.workers)
    if is_main():
        print(f"bayesify: {spec['batches'].describe()}", file=sys.stderr)
    staged = StagedOutput(Path(args.out))
    with staged as out:
        bnn = bayesify(model, args.method, **options)
        # the validation split tunes the family's predictive knob (SWAG's scale, Laplace's τ)
        fit_kwargs.setdefault("val_loader", loaders["val"])
        history = _fit_or_tune(bnn, loaders, args, fit_kwargs, log_dir=out)
        val = bnn.predictor(seed=args.seed).evaluate(loaders["val"],
                                                     progress=show_progress(args))
        if is_main():
            save_checkpoint(model, out / BASE_FILE)  # bayesify() wrapped a copy
            bnn.save_posterior(out)
            write_json(out / "final_metrics.json", val)
            write_json(out / RUN_FILE, {
                "data": spec["data"] if spec["data"] == "digits" else
                portable_path(spec["data"], Path(args.out)), "model": spec["model"],
                "image_size": spec["image_size"], "pretrained": spec["pretrained"],
                "classes": spec["classes"], "method": args.method, "options": options,
                "seed": args.seed, "paths": RUN_PATHS,
                "fit": {k: v for k, v in fit_kwargs.items() if not k.endswith("_loader")},
                "history": history, "val": val, "outcome": fit_outcome(history),
            })
    if is_main():
        print(bnn.summary())
        print("\nvalidation:\n" + format_metrics(val))
        print("\n" + staged.summary())
    return exit_if_worse(history, Path(args.out), args.method)


def fit_outcome(history: list[dict[str, Any]]) -> dict[str, Any]:
    """What run.json records of the fit's comparison with its starting network (the
    validated start, the state kept, whether it is still clearly worse)."""
    first, last = (history[0], history[-1]) if history else ({}, {})
    keys = ("kept", "kept_val_accuracy", "kept_val_nll", "worse_than_start")
    return {**{k: first[k] for k in ("start_val_accuracy", "start_val_nll") if k in first},
            **{k: last[k] for k in keys if k in last}}


def exit_if_worse(history: list[dict[str, Any]], out: Path, method: str) -> int:
    """3 (and the comparison on stderr) when the fitted posterior is clearly worse on
    validation than the network it started from, else 0."""
    outcome = fit_outcome(history)
    if not outcome.get("worse_than_start"):
        return 0
    if is_main():
        print(f"bayesify: error: the posterior in {out} is worse on validation than the network "
              f"it started from (accuracy {outcome['kept_val_accuracy']:.4f} vs "
              f"{outcome['start_val_accuracy']:.4f}, NLL {outcome['kept_val_nll']:.4f} vs "
              f"{outcome['start_val_nll']:.4f}; kept: {outcome['kept']}). It is written for "
              "inspection, not for use: try a lower --lr, fewer --epochs or a smaller initial "
              f"spread (`bayesify methods {method}`)", file=sys.stderr)
    return 3


def _fit_or_tune(bnn: Any, loaders: dict[str, Any], args: argparse.Namespace,
                 fit_kwargs: dict[str, Any], *, log_dir: Path) -> list[dict[str, Any]]:
    """``fit``; a family with nothing to train (post-hoc MC dropout, the default; with
    ``--train-weights`` it fine-tunes) skips the training epochs and only runs the
    validation search (``bayesify.tune``; with its member-wise Laplace heads, their pass over
    up to 10,000 training examples first, as ``fit`` does)."""
    from bayesify.train.loop import fit
    from bayesify.train.tuning import tune

    trainable = any(p.requires_grad for p in bnn.posterior_parameters())
    step = bnn.method.step()
    nothing = step.trains_nothing or (step.optimizes and not trainable)
    if nothing and not args.base_lr:
        if is_main():
            print(f"bayesify: {args.method} has no trainable posterior parameters: no training "
                  "epochs, the validation search only", file=sys.stderr)
        return [{"epoch": 0, "steps": 0, **tune(bnn, fit_kwargs["val_loader"],
                                                 train_loader=loaders["train"])}]
    result = fit(bnn, loaders["train"], progress=show_progress(args), base_lr=args.base_lr,
                 optimizer=args.optimizer, log_dir=log_dir, **fit_kwargs)
    return result.history


# -- evaluate -------------------------------------------------------------------------------
def _add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, posterior=True)
    parser.add_argument("--split", choices=("val", "test"), default="test",
                        help="split to evaluate (folders without test/ use val/; default: test)")
    parser.add_argument("--out", default=None,
                        help="directory for metrics.json, reliability.png, uncertainty_hist.png "
                             "(default: RUN/evaluate, or bayesify-eval)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG figures")


def _run_evaluate(args: argparse.Namespace) -> int:

    out = Path(args.out or (Path(args.posterior) / "evaluate" if args.posterior
                            else "bayesify-eval"))
    check_out(out)
    model, bundle, spec = resolve(args)
    predictor = load_predictor(args, model)
    loaders = bundle.loaders(batch_size=args.batch_size, seed=args.seed, workers=args.workers)
    split = args.split if args.split in loaders else "val"
    # one pass over the data: metrics and figures both read the collected predictions
    raw, labels = predictor.collect_predictions(loaders[split], where=f"evaluate {split}",
                                                progress=show_progress(args))
    ood = (predictor.collect_predictions(loaders["ood"], where="evaluate OOD",
                                         progress=show_progress(args))[0]
           if "ood" in loaders else None)
    replay = _Replay(raw if ood is None else Prediction.cat([raw, ood]), predictor.temperature)
    n = raw.mean.shape[0] if raw.is_gaussian else raw.member_logits.shape[1]
    n_ood = 0 if ood is None else (ood.mean.shape[0] if ood.is_gaussian else ood.member_logits.shape[1])
    result = replay.evaluate(replay.loader(0, n, labels),
                             None if ood is None else replay.loader(n, n_ood), progress=False)
    result.update({"split": args.split, "temperature": predictor.temperature,
                   "method": getattr(getattr(predictor, "bnn", None), "method_name", "map"),
                   "model": spec["model"], "data": spec["data"]})
    staged = StagedOutput(out)
    with staged as stage:
        if is_main():
            write_json(stage / "metrics.json", result)
        if is_main() and not args.no_plots:
            pred = raw.scaled(predictor.temperature)
            conf, guess = pred.probs.max(-1)
            plots.save_reliability_diagram(
                {result["method"]: (conf, (guess == labels).float())}, stage / "reliability.png")
            groups = {f"{args.split} (in distribution)": _uncertainty(pred)}
            if ood is not None:
                groups["OOD"] = _uncertainty(ood.scaled(predictor.temperature))
            plots.save_uncertainty_histograms({result["method"]: groups},
                                           stage / "uncertainty_hist.png", bundle.num_classes)
    if is_main():
        print(format_metrics(result))
        print("\n" + staged.summary())
    return 0


def _uncertainty(pred: Prediction) -> dict[str, torch.Tensor]:
    return {"entropy": pred.entropy, "epistemic": pred.epistemic}


class _Replay(BasePredictor):
    """Raw predictions (members or moments) computed once; a "batch" is an index tensor
    into N. Lets ``evaluate`` and the figures share one pass of the network over the data.
    """

    def __init__(self, prediction: Prediction, temperature: float) -> None:
        self.prediction, self.temperature = prediction, float(temperature)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def predict(self, index: torch.Tensor) -> Prediction:
        return self.prediction.rows(index)

    def loader(self, start: int, count: int, labels: torch.Tensor | None = None,
               chunk: int = 4096) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(torch.arange(start + i, start + min(i + chunk, count)),
                 None if labels is None else labels[i:i + chunk])
                for i in range(0, count, chunk)]


def refuse_worse_run(posterior: str | None) -> None:
    """A run whose fit ended worse on validation than its starting network is not calibrated:
    a temperature would flatten the collapse into a well-calibrated-looking predictive."""
    if not posterior:
        return
    path = Path(posterior) / RUN_FILE
    try:
        outcome = json.loads(path.read_text()).get("outcome", {}) if path.is_file() else {}
    except (OSError, ValueError, AttributeError):
        return  # resolve() reports a damaged run.json
    if isinstance(outcome, dict) and outcome.get("worse_than_start"):
        raise BayesifyError(
            f"{posterior}: its fit ended worse on validation than the network it started from "
            f"(accuracy {outcome.get('kept_val_accuracy')} vs {outcome.get('start_val_accuracy')}, "
            f"NLL {outcome.get('kept_val_nll')} vs {outcome.get('start_val_nll')}); calibrating "
            "it would hide that behind a flat predictive. Fit again (a lower --lr, fewer "
            "--epochs) and calibrate that run")


# -- calibrate ------------------------------------------------------------------------------
def _add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, posterior=True)
    parser.add_argument("--calibration", choices=("temperature",), default="temperature",
                        help="calibration method (default: temperature); --method is the "
                             "posterior family, as in every command")
    parser.add_argument("--out", default=None,
                        help="directory for calibration.json and calibration_reliability.png "
                             "(default: the --posterior directory, so evaluate/export use it)")
    parser.add_argument("--force", action="store_true",
                        help="re-fit a temperature that the validation search of `fit` chose "
                             "(refused otherwise: the search saw shift, calibration does not)")


def _run_calibrate(args: argparse.Namespace) -> int:
    from bayesify.predict.calibration import calibration_record, calibration_stats

    out = Path(args.out or args.posterior or "bayesify-calibration")
    check_out(out)
    refuse_worse_run(args.posterior)
    model, bundle, _ = resolve(args)
    # start from the posterior's own temperature (the one its fit chose and stored), not
    # from a previous calibration.json: calibrating twice gives the same answer
    predictor = load_predictor(args, model, calibration_file=False)
    bnn = getattr(predictor, "bnn", None)
    if bnn is not None and bnn.temperature_source == "search" and not args.force:
        raise BayesifyError(
            f"calibrate: the temperature of {args.posterior} "
            f"({bnn.state.value('temperature'):.4g}) was chosen by fit's validation search with "
            "the posterior's knob, on clean and shifted data; a clean-only re-fit would undo "
            "it. Use the posterior as it is, or pass --force to calibrate anyway")
    loaders = bundle.loaders(batch_size=args.batch_size, seed=args.seed, workers=args.workers)
    staged = StagedOutput(out)
    with staged as stage:
        plot = stage / "calibration_reliability.png" if is_main() else None
        result = predictor.calibrate(loaders["val"], method=args.calibration, plot=plot,
                                     progress=show_progress(args), force=True)
        test_logits, test_labels = predictor.collect(loaders["test"], where="calibrate (test)",
                                                     progress=show_progress(args))
        payload = calibration_record(result, args.posterior)  # tied to this posterior
        if payload.get("plot"):
            payload["plot"] = str(out / Path(payload["plot"]).name)
        for tag, temp in (("before", result.previous_temperature),
                          ("after", result.temperature)):
            nll, ece, _, _ = calibration_stats(test_logits, test_labels, temp)
            payload[f"test_nll_{tag}"], payload[f"test_ece_{tag}"] = nll, ece
        if is_main():
            write_json(stage / CALIBRATION_FILE, payload)
    if is_main():
        print(calibration_summary(payload) + "\n")
        print(format_metrics(payload))
        print("\n" + staged.summary())
    return 0


def calibration_summary(record: dict[str, Any]) -> str:
    """The temperature ``bayesify calibrate`` applies, in words: where it started, the NLL
    optimum, and why the applied value may differ from the optimum (the rule)."""
    applied, start = record["temperature"], record["previous_temperature"]
    owner = "the posterior's own" if record.get("posterior_checksum") else "no temperature"
    nll = f"validation NLL {record['nll_before']:.4f} -> {record['nll_after']:.4f}"
    lines = [f"applied temperature {applied:.4g} ({nll})", f"  started from {start:.4g}, {owner}"]
    if record["kept_previous"]:
        lines.append("  kept: no other temperature lowered the validation NLL")
        return "\n".join(lines)
    lines[1] += f"; validation NLL optimum {record['optimum_temperature']:.4g}"
    if record.get("rule") == "one_se" and not math.isclose(applied, record["optimum_temperature"],
                                                           rel_tol=1e-6):
        lines.append("  rule 'one_se': the softest temperature within one standard error of "
                     "the optimum's NLL")
    return "\n".join(lines)


# -- export ---------------------------------------------------------------------------------
def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, posterior=True)
    parser.add_argument("--format", choices=("pt2", "onnx"), default=None,
                        help="torch.export program (.pt2) or ONNX; the --output suffix decides "
                             "and --format may only repeat it (default: pt2 without --output)")
    parser.add_argument("--output", default=None,
                        help="file to write, named .pt2 or .onnx; FILE.json (metadata: class "
                             "names, preprocessing, family) and FILE.sha256 (integrity record) "
                             "are written beside it (default: RUN/predictor.pt2 or .onnx)")
    parser.add_argument("--example-batch", type=int, default=2,
                        help="rows of the validation split used as the example input; the "
                             "batch axis of the export stays dynamic (default: 2)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip reloading the export and comparing it with the in-process "
                             "predictor")


def _run_export(args: argparse.Namespace) -> int:
    from bayesify.predict.export import format_of

    suffix = f".{args.format or 'pt2'}"
    output = Path(args.output or Path(args.posterior or ".") / f"predictor{suffix}")
    fmt = format_of(output, args.format)  # the suffix decides; --format may only repeat it
    check_out(output.parent, "--output")
    if args.example_batch < 1:
        raise BayesifyError(f"--example-batch must be >= 1, got {args.example_batch}")
    model, bundle, spec = resolve(args)
    predictor = load_predictor(args, model)
    rows = [bundle.val[i][0] for i in range(min(args.example_batch, len(bundle.val)))]
    staged = StagedOutput(output.parent)
    with staged as stage:
        if is_main():
            info = predictor.export(stage / output.name, torch.stack(rows), format=fmt,
                                    verify=not args.no_verify, class_names=spec["classes"],
                                    preprocessing=_eval_preprocessing(spec, model))
    if is_main():
        info = {k: str(v).replace(str(stage), str(output.parent)) if isinstance(v, (str, Path))
                else v for k, v in info.items() if k not in ("metadata", "files")}
        print(format_metrics(info))
        print("\n" + staged.summary())
    return 0


def _eval_preprocessing(spec: dict[str, Any], model: Any) -> dict[str, Any]:
    """What turns an input image into the exported program's tensor, as data."""
    from bayesify.data import sources
    from bayesify.predict.preprocessing import describe_transform

    channels, size = sources.model_input(spec["model"], spec["data"], spec["image_size"])
    if spec["data"] == sources.DIGITS:
        text = ("scikit-learn digits: 8x8 grey levels / 16 in [0, 1]"
                + (f", bilinear resize to {size}x{size}" if size != 8 else "")
                + (", grey repeated to 3 channels" if channels == 3 else ""))
        return {"source": "bayesify digits", "steps": [{"op": "note", "text": text}],
                "input_size": [channels, size, size]}
    _, transform = sources.model_transforms(model, spec["model"], image_size=size)
    return describe_transform(transform, source=f"{spec['model']} eval transform")


# -- demo / methods -------------------------------------------------------------------------
def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bayesify-demo",
                        help="output directory for results.json and the PNG figures "
                             "(default: %(default)s)")
    parser.add_argument("--methods", default="ibnn,laplace",
                        help="comma-separated posterior families to compare with MAP, e.g. "
                             "'ibnn,rank1,dropout' (default: %(default)s — the default family "
                             "and the one the quality benchmarks recommend; see `bayesify "
                             "methods`)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data split, MAP training and posterior (default: 0)")
    parser.add_argument("--map-epochs", type=int, default=40,
                        help="epochs of plain MAP training of the 'pretrained' CNN (default: 40)")
    parser.add_argument("--epochs", type=int, default=None, help=EPOCHS_HELP)
    parser.add_argument("--no-progress", action="store_true", help="hide tqdm progress bars")
    parser.add_argument("--no-plots", action="store_true",
                        help="skip the reliability diagram and entropy histogram PNGs")


def _run_demo(args: argparse.Namespace) -> int:
    import time

    from bayesify.demo import compare_to_map, format_table, run_demo

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    start = time.perf_counter()
    results = run_demo(out_dir=args.out, methods=methods, seed=args.seed,
                       map_epochs=args.map_epochs, epochs=args.epochs,
                       progress=not args.no_progress, plots=not args.no_plots)
    print(format_table(results))
    print("\n" + "\n".join(compare_to_map(results)))
    print(f"\ndemo took {time.perf_counter() - start:.0f} s")
    print(f"wrote {args.out}/results.json" + ("" if args.no_plots else
          f", {args.out}/reliability.png, {args.out}/uncertainty_hist.png"))
    return 0


def _add_methods_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="show the options of this family")


def _run_methods(args: argparse.Namespace) -> int:
    from bayesify import describe_method, list_methods, method_summary

    if args.name is None:
        names = list_methods()
        width = max(len(n) for n in names)
        print("\n".join(f"{n.ljust(width)}  {method_summary(n)}" for n in names))
        return 0
    print(f"{args.name}: {method_summary(args.name)}")
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


def build_parser(fit_method: str = "ibnn", *, show_family: bool = False) -> argparse.ArgumentParser:
    """The ``bayesify`` parser; ``fit`` carries the options of ``fit_method``.

    ``show_family``: list those options in ``fit --help`` (``fit --method NAME``
    was given); otherwise ``fit --help`` points to the per-family help.
    """
    from bayesify import __version__

    parser = argparse.ArgumentParser(
        allow_abbrev=False,  # `--component 4` must not silently mean --components
        prog="bayesify",
        description="Turn a pretrained PyTorch network into a Bayesian one: fit, evaluate, "
                    "calibrate and export posteriors.",
    )
    parser.add_argument("--version", action="version", version=f"bayesify {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if name == "fit":
            p.usage = "bayesify fit [--data DATA] [--model MODEL] [--method NAME] [options]"
            _add_fit_arguments(p, method=fit_method, show_family=show_family)
            if show_family:
                from bayesify.train.imagenet import family_help_only

                family_help_only(p, "bayesify fit")
        else:
            add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from bayesify.core.registry import list_methods
    from bayesify.train.imagenet import peek_method

    argv = sys.argv[1:] if argv is None else list(argv)
    method, given = peek_method(argv[1:]) if argv[:1] == ["fit"] else ("ibnn", False)
    known = method in list_methods()
    parser = build_parser(method if known else "ibnn", show_family=given and known)
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except BayesifyError as err:
        if is_main():
            print(f"bayesify: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
