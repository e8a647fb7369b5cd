"""Exceptions raised by bayesify."""

from __future__ import annotations


class BayesifyError(ValueError):
    """Bad input to bayesify: the message says what was wrong and what would be right."""


class NonFiniteLossError(BayesifyError, FloatingPointError):
    """The training loss became NaN or infinite; the message names the step."""
