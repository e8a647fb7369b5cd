"""Issue 24, the library in a user's own stack: one default budget for every entry point,
progress and log lines on every long phase, warnings that name the family and the fix.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from bayesify.cli import build_parser
from bayesify.train.loop import DEFAULT_MIN_STEPS, EPOCHS_HELP


def _epochs_action(parser):
    return next(a for a in parser._actions if "--epochs" in a.option_strings)


def test_every_entry_point_defaults_to_fits_budget_and_says_so():
    from bayesify.demo import run_demo
    from tests.test_imagenet_script import _script

    sub = next(a for a in build_parser()._actions if isinstance(getattr(a, "choices", None), dict))
    actions = [_epochs_action(sub.choices["fit"]), _epochs_action(sub.choices["demo"]),
               _epochs_action(_script().build_parser(show_family=False))]
    for action in actions:
        assert action.default is None and action.help == EPOCHS_HELP
    assert f"at least {DEFAULT_MIN_STEPS} optimiser steps" in EPOCHS_HELP
    assert inspect.signature(run_demo).parameters["epochs"].default is None


def test_cli_fit_leaves_epochs_to_fit_unless_given(tmp_path):
    from bayesify.cli import _fit_plan

    parser = build_parser()
    args = parser.parse_args(["fit", "--data", "digits", "--out", str(tmp_path / "a")])
    assert "epochs" not in _fit_plan(args)[1]
    args = parser.parse_args(["fit", "--data", "digits", "--epochs", "3",
                              "--out", str(tmp_path / "b")])
    assert _fit_plan(args)[1]["epochs"] == 3


def test_library_loggers_are_children_of_bayesify():
    root = Path(__file__).resolve().parents[1] / "bayesify"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert 'getLogger("bayesify")' not in text, f"{path}: use logging.getLogger(__name__)"
    from bayesify.train import loop, tuning

    assert {loop.logger.name, tuning.logger.name} == {"bayesify.train.loop", "bayesify.train.tuning"}
