"""Which part of a model's output are the class logits: the one rule, and ``output_fn=``.

The rule (:func:`logits_of`), applied to whatever the wrapped network returns:

- a tensor ``[B, C]`` with ``C >= 2`` is the logits (``[B, C, 1, …, 1]`` from a fully
  convolutional head is read as ``[B, C]``);
- an object with a ``.logits`` attribute (Hugging Face ``ModelOutput``) or a mapping
  with a ``"logits"`` key: that entry;
- a tuple / list of exactly one tensor: that tensor;
- anything else is refused with a :class:`~bayesify.errors.ModelOutputError` (both a
  :class:`BayesifyError` and a ``TypeError``) that
  says what was returned and which ``output_fn=`` would pick the logits: a longer
  tuple (``(features, logits)``), per-pixel / per-token outputs (``[B, C, H, W]``,
  ``[B, T, C]``), one output per example (``[B]``, ``[B, 1]``) and fewer than two
  classes. Guessing is what made a ``(features, logits)`` model look like a
  ``features``-many-class classifier.

``bayesify(model, output_fn=...)`` installs a forward hook on the wrapped network
that maps its output before the rule sees it, so every part of bayesify (training,
prediction, Laplace's Jacobians, exports, ``unwrap()`` — whose copy keeps the hook)
reads the same logits. ``output_fn`` is

- a **name**: ``"logits"`` / any string (attribute, else mapping key) or an ``int``
  (tuple index, ``output_fn=1`` for ``(features, logits)``); it is stored in the
  posterior manifest and re-applied by ``load_posterior``;
- or a **callable** ``output → logits``; it cannot be stored in a file, so the
  manifest records only that one was used and ``load_posterior(base, dir,
  output_fn=...)`` must be given it again.

Probabilities are not logits: :func:`check_not_probabilities` refuses outputs whose
every row is a probability vector (softmax outputs); ``torch.log`` of them (or
log-softmax outputs, which *are* logits up to a constant) work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from bayesify.errors import BayesifyError, ModelOutputError

__all__ = [
    "OutputFn",
    "check_not_probabilities",
    "describe_output",
    "install_output_fn",
    "logits_of",
    "output_fn_of",
    "output_fn_record",
    "resolve_output_fn",
]

#: what ``output_fn=`` may be: a stored name (attribute / key) or index, or a callable
OutputFn = str | int | Callable[[Any], Any]

_HINT = ("pass bayesify(model, ..., output_fn=...) naming the logits: an index "
         "(output_fn=1 for (features, logits)), an attribute or key (output_fn='logits'), "
         "or a function (output_fn=lambda out: out[1])")


def describe_output(output: Any) -> str:
    """A short description of a model output: types and shapes, nested one level."""
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {list(output.shape)}"
    if isinstance(output, (tuple, list)):
        parts = [f"[{', '.join(map(str, o.shape))}]" if isinstance(o, torch.Tensor)
                 else type(o).__name__ for o in output[:6]]
        more = ", …" if len(output) > 6 else ""
        return f"a {type(output).__name__} of {len(output)} ({', '.join(parts)}{more})"
    if isinstance(output, Mapping):
        return f"a {type(output).__name__} with keys {list(output)[:8]}"
    return f"a {type(output).__name__}"


def _check_logits_shape(logits: torch.Tensor, output: Any) -> torch.Tensor:
    if logits.dim() > 2 and all(d == 1 for d in logits.shape[2:]):
        logits = logits.flatten(1)  # a fully convolutional head: [B, C, 1, 1] is one pixel
    if logits.dim() == 2 and logits.shape[-1] >= 2:
        return logits
    what = describe_output(output)
    if logits.dim() == 2 or logits.dim() == 1:
        raise ModelOutputError(
            f"the model returns {what}: one output per example, but bayesify needs class "
            "logits [B, C] with at least 2 classes. A 1-class model has nothing to be "
            "uncertain about; for a binary classifier with one logit z pass "
            "output_fn=lambda z: torch.cat([torch.zeros_like(z), z], -1) (softmax of [0, z] "
            "is the sigmoid), with z of shape [B, 1]"
        )
    if logits.dim() == 0:
        raise ModelOutputError(f"the model returns {what} (a scalar); bayesify needs class "
                            "logits of shape [B, C]")
    raise ModelOutputError(
        f"the model returns {what}: bayesify classifies whole examples and needs logits of "
        "shape [B, C], not per-pixel or per-token outputs ([B, C, H, W] segmentation maps, "
        "[B, T, C] token logits). Pool them to one row per example, e.g. "
        "output_fn=lambda out: out.mean((2, 3)), or wrap a classification head"
    )


def logits_of(output: Any) -> torch.Tensor:
    """Class logits ``[B, C]`` from a model output by the rule of this module."""
    if isinstance(output, torch.Tensor):
        return _check_logits_shape(output, output)
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return _check_logits_shape(logits, output)
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return _check_logits_shape(output["logits"], output)
    if isinstance(output, (tuple, list)):
        if len(output) == 1 and isinstance(output[0], torch.Tensor):
            return _check_logits_shape(output[0], output)
        raise ModelOutputError(f"the model returns {describe_output(output)}; bayesify does not "
                        f"guess which entry holds the class logits: {_HINT}")
    raise ModelOutputError(f"cannot find class logits in the model output ({describe_output(output)}); "
                    f"{_HINT}")


def same_softmax(out: Any, logits: torch.Tensor, *, atol: float = 1e-4) -> bool:
    """Whether ``out`` (a classifier's output) gives the model's ``logits`` up to a constant
    per row — the same softmax: the logits themselves, or a ``log_softmax`` after the
    classifier (log-probabilities are valid logits; the classic MNIST net ends in one)."""
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape or out.dim() < 1:
        return False
    if torch.equal(out, logits):
        return True
    gap = out.double() - logits.double()
    spread = (gap - gap.mean(-1, keepdim=True)).abs().max()
    return bool(spread <= atol * (1.0 + out.detach().double().abs().max()))


def classifier_rows(a: torch.Tensor, out: torch.Tensor,
                    logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The classifier's input and output rows that make the model's ``logits [B, C]``: ``(a,
    out)`` as they are for ``out [B, C]``; for a classifier applied at every position and
    then gathered (``out [B, L, C]``: a decoder's ``score`` in transformers'
    ``GPT2ForSequenceClassification``, Llama's, Qwen's — the last non-padding token), the
    position of each row whose output gives the logits (up to a constant per row, as
    :func:`same_softmax`; its check follows). Traceable by ``torch.export``."""
    if not (isinstance(out, torch.Tensor) and isinstance(a, torch.Tensor)
            and out.dim() == 3 and logits.dim() == 2 and a.dim() == 3
            and out.shape[0] == logits.shape[0] == a.shape[0] and out.shape[1] == a.shape[1]
            and out.shape[-1] == logits.shape[-1]):
        return a, out
    centred = out - out.mean(-1, keepdim=True)
    target = (logits - logits.mean(-1, keepdim=True)).to(centred.dtype).unsqueeze(1)
    position = (centred - target).abs().amax(-1).argmin(-1)
    rows = torch.arange(out.shape[0], device=out.device)
    return a[rows, position], out[rows, position]


def check_not_probabilities(logits: torch.Tensor, *, where: str) -> None:
    """Refuse an output whose every row is a probability vector (a softmax output).

    Probabilities used as logits are softmax-ed a second time: the predictive becomes
    nearly uniform and every uncertainty is wrong. Log-probabilities are fine.
    """
    if logits.numel() == 0 or not logits.is_floating_point():
        return
    flat = logits.detach().reshape(-1, logits.shape[-1]).float()
    if bool(((flat >= 0) & (flat <= 1)).all()) and bool(
            ((flat.sum(-1) - 1).abs() <= 1e-3).all()):
        raise ModelOutputError(
            f"{where}: the model outputs probabilities (every row lies in [0, 1] and sums to "
            "1), but bayesify needs logits (it applies the softmax itself). Remove the final "
            "softmax, or pass output_fn=lambda p: p.clamp_min(1e-12).log() (log-probabilities "
            "are valid logits)"
        )


class _OutputHook:
    """Forward hook replacing the network's output by ``fn(output)``."""

    def __init__(self, spec: OutputFn, fn: Callable[[Any], Any]) -> None:
        self.spec = spec
        self.fn = fn

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return self.fn(output)


def _named(spec: str | int) -> Callable[[Any], Any]:
    def pick(output: Any) -> Any:
        try:
            if isinstance(spec, int):
                return output[spec]
            if hasattr(output, spec) and not isinstance(output, Mapping):
                return getattr(output, spec)
            return output[spec]
        except (IndexError, KeyError, TypeError, AttributeError) as err:
            raise ModelOutputError(f"output_fn={spec!r} does not select anything from "
                                f"{describe_output(output)} ({type(err).__name__}: {err})") from err

    pick.__name__ = f"output_fn_{spec}"
    return pick


def resolve_output_fn(spec: Any) -> Callable[[Any], Any] | None:
    """The function of an ``output_fn=`` value (``None`` stays ``None``); refuses others."""
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise TypeError(f"output_fn must be a name, an index or a function, got bool {spec!r}")
    if isinstance(spec, (str, int)):
        if isinstance(spec, str) and not spec:
            raise BayesifyError("output_fn='' names nothing; give an attribute or key name")
        return _named(spec)
    if callable(spec):
        return spec
    raise TypeError(f"output_fn must be a name (str), an index (int) or a function of the "
                    f"model output, got {type(spec).__name__} {spec!r}")


def install_output_fn(model: nn.Module, spec: OutputFn | None) -> None:
    """Register the hook mapping ``model``'s output through ``spec`` (no-op for ``None``)."""
    fn = resolve_output_fn(spec)
    if fn is None:
        return
    if output_fn_of(model) is not None:
        raise BayesifyError("the model already has a bayesify output_fn hook")
    model.register_forward_hook(_OutputHook(spec, fn))


def output_fn_of(model: nn.Module) -> OutputFn | None:
    """The ``output_fn=`` spec installed on ``model`` (``None`` when there is none)."""
    for hook in model._forward_hooks.values():
        if isinstance(hook, _OutputHook):
            return hook.spec
    return None


def output_fn_record(spec: OutputFn | None) -> Any:
    """What the posterior manifest stores for ``spec``: the name / index itself, ``None``,
    or ``{"callable": qualified name}`` for a function (which a file cannot hold)."""
    if spec is None or isinstance(spec, (str, int)):
        return spec
    name = getattr(spec, "__qualname__", None) or type(spec).__name__
    return {"callable": f"{getattr(spec, '__module__', '?')}.{name}"}
