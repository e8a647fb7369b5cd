"""The wrapped network's call signature on ``BayesianModel.forward`` (as PEFT does).

Libraries read a model's inputs off ``inspect.signature(model.forward)``: the Hugging Face
``Trainer`` drops every dataset column that is not a parameter name there
(``remove_unused_columns``). ``BayesianModel.forward(*args, **kwargs)`` would hide the
wrapped model's ``input_ids``, ``attention_mask``, ``labels`` and the Trainer would hand
it empty batches. :func:`forward_with_signature` gives one wrapper its own bound
``forward`` — the same code as the class's — carrying the wrapped model's signature
(PEFT's ``update_forward_signature``); calls still go through ``*args, **kwargs``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

from torch import nn


def base_signature(model: nn.Module) -> inspect.Signature | None:
    """``inspect.signature(model.forward)`` (without ``self``), or ``None`` when it cannot
    be read or says nothing more than ``(*args, **kwargs)``."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    kinds = {p.kind for p in signature.parameters.values()}
    if kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None
    return signature


def forward_with_signature(owner: nn.Module, forward: Callable[..., Any],
                           model: nn.Module) -> Callable[..., Any] | None:
    """``forward`` (an unbound function ``(self, *args, **kwargs)``) bound to ``owner``
    as a copy whose ``__signature__`` is ``model``'s forward signature; ``None`` when
    that signature says nothing (then the class's own ``forward`` stays)."""
    signature = base_signature(model)
    if signature is None:
        return None
    copy = types.FunctionType(forward.__code__, forward.__globals__, forward.__name__,
                              forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__ = forward.__kwdefaults__
    copy.__qualname__ = forward.__qualname__
    copy.__doc__ = forward.__doc__
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    copy.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self_parameter, *signature.parameters.values()])
    return types.MethodType(copy, owner)
