"""The ``bayesify`` console script.

Sub-commands register themselves in :data:`COMMANDS` as ``name → (add_arguments,
run)``; ``bayesify --help`` lists them and ``bayesify CMD --help`` explains every
flag.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from bayesify.errors import BayesifyError


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


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
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
