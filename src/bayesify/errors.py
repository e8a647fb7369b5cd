"""Exceptions raised by bayesify."""

from __future__ import annotations


class BayesifyError(ValueError):
    """Bad input to bayesify: the message says what was wrong and what would be right."""


class NonFiniteLossError(BayesifyError, FloatingPointError):
    """The training loss became NaN or infinite; the message names the step."""


class ModelOutputError(BayesifyError, TypeError):
    """The model's output is not class logits bayesify can read (a tuple without
    ``output_fn=``, per-pixel maps, probabilities, fewer than 2 classes); both a
    :class:`BayesifyError` and a ``TypeError``."""
