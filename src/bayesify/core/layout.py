"""Where every wrapped layer's input keeps the batch: found once, from the network itself.

The families deal the rows of a layer's input to posterior members (the sampling plan of
:mod:`bayesify.core.context`), which needs the batch in the input's first dimension. Three
other layouts exist in real networks:

* **sequence first** — ``[length, batch, features]``: ``nn.TransformerEncoder`` with its
  default ``batch_first=False`` (PyTorch's own tutorials), Hugging Face's XLNet. Before the
  thirty-sixth stop every family that deals rows stopped at the first forward ("a wrapped
  layer received 10 rows but the sampling plan has 32") — or, where the length was a
  multiple of the plan's rows, dealt *positions* to members, silently;
* **batch-free** — a table every example shares (Swin V2's continuous position bias MLP on
  its coordinate table): the layer runs as the network's own
  (:meth:`~bayesify.core.layers.BayesianLayer.__call__`);
* **batch-major reshaped** — ``[batch·windows, ...]`` (window attention): the plan's rows
  are repeated (:func:`~bayesify.core.context.expand_plan_rows`), as before.

A single call cannot tell them apart (a sequence of 32 tokens in a batch of 32 rows looks
batch-first), so the first forward of a bayesified network under a sampling plan runs the
network twice more first, on 2 and on 3 copies of its first example, every wrapped layer
passing its input to its network layer and recording its shape: the dimension that grows
by 3/2 is the batch (:func:`batch_dimension`). The library's model calls run it
(:func:`before_call`; no hook on the user's modules); traced or compiled forwards skip it,
and a network whose probe fails keeps the old rules (logged)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from bayesify.core.context import SamplingContext

logger = logging.getLogger(__name__)

#: the number of rows of the two probe passes (copies of the first example)
PROBE_ROWS = (2, 3)


def batch_dimension(small: list[torch.Size | None], large: list[torch.Size | None],
                    rows: tuple[int, int] = PROBE_ROWS) -> int | None | str:
    """The batch dimension of one layer's input from its calls in the two probe passes
    (``small``: the shapes of its first tensor argument in the pass of ``rows[0]`` rows, one
    per call; ``large``: of ``rows[1]``): 0 or 1 (the first dimension whose size grows by
    ``rows[1] / rows[0]``, on every call), None where no dimension grows (a batch-free input)
    and ``"unknown"`` where the calls disagree or the shapes are not comparable."""
    if not small or len(small) != len(large):
        return "unknown"
    found: set[int | None] = set()
    for a, b in zip(small, large, strict=True):
        if a is None or b is None or len(a) != len(b):
            return "unknown"
        if tuple(a) == tuple(b):
            found.add(None)
            continue
        grows = [d for d in range(len(a))
                 if a[d] > 0 and a[d] * rows[1] == b[d] * rows[0]]
        if not grows or grows[0] > 1:
            return "unknown"
        found.add(grows[0])
    return found.pop() if len(found) == 1 else "unknown"


#: every bayesified network (the module ``BayesianModel.model``) → its sampling context; a
#: registry, not a hook: the user's modules carry no hooks (``bayesify(..., inplace=True)``)
_NETWORKS: weakref.WeakKeyDictionary[nn.Module, SamplingContext] = weakref.WeakKeyDictionary()


def install(model: nn.Module, context: SamplingContext) -> None:
    """Probe ``model``'s layouts at its first call under a plan of ``context``
    (:func:`before_call`, from :func:`bayesify.core.batch.call_model` and its kin)."""
    _NETWORKS[model] = context


def before_call(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run the probe before ``model(*args, **kwargs)`` where ``model`` is a bayesified network
    (or a data-parallel wrapper of one) not probed yet, called under a sampling plan, eagerly."""
    if torch.compiler.is_compiling():  # traced: the layers keep the old rules (and the
        return  # compiled graph holds no guard on the registry)
    context = _NETWORKS.get(model) if isinstance(model, nn.Module) else None
    if context is None:
        inner = getattr(model, "module", None)  # DistributedDataParallel, DataParallel
        context = _NETWORKS.get(inner) if isinstance(inner, nn.Module) else None
        model = inner
    if context is None or context.layout_probed or context.probing:
        return
    if context.planned_rows() is None:
        return  # no plan yet
    context.layout_probed = True  # once, whatever happens
    try:
        probe(model, context, args, kwargs)
    except Exception as err:  # noqa: BLE001 - the old rules stay; say why
        for layer in _layers(model, context):
            layer.layout = "unknown"
        logger.info("bayesify could not probe where the layers' inputs keep the batch "
                    "(%s: %s); every wrapped layer takes its first dimension as the batch",
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")


def _layers(model: nn.Module, context: SamplingContext) -> list[Any]:
    from bayesify.core.layers import BayesianLayer

    return [m for m in model.modules()
            if isinstance(m, BayesianLayer) and m.context is context and m.deals_rows]


def _rows_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    raise ValueError("no input tensor with a batch dimension")


def _copies(value: Any, rows: int, count: int) -> Any:
    """``value`` with every input tensor of ``rows`` rows replaced by ``count`` copies of its
    first row (other values as they are)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
        return value[:1].expand(count, *value.shape[1:]).contiguous()
    return value


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


#: a module's hook dictionaries the probe's passes run without
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
          "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


@contextmanager
def _without_hooks(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` without its forward hooks (the probe reads shapes only;
    a hook that captures activations — the member-wise Laplace heads' feature taps — must
    not see its passes)."""
    stashed = []
    for m in model.modules():
        for name in _HOOKS:
            hooks = getattr(m, name, None)
            if hooks:
                stashed.append((hooks, dict(hooks)))
                hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in stashed:
            hooks.update(saved)


@torch.no_grad()
def probe(model: nn.Module, context: SamplingContext, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> None:
    """Run ``model`` on :data:`PROBE_ROWS` copies of the first example of ``args``/``kwargs``
    (eval mode, no gradients, no forward hooks, every wrapped layer as its network layer)
    and set every wrapped layer's ``layout`` (:func:`batch_dimension`)."""
    layers = _layers(model, context)
    if not layers:
        return
    rows = _rows_of(args, kwargs)
    seen: dict[int, list[list[torch.Size | None]]] = {id(layer): [] for layer in layers}
    context.probing = True
    try:
        with _eval_mode(model), _without_hooks(model):
            for count in PROBE_ROWS:
                for layer in layers:
                    layer.probe_shapes = []
                model(*(_copies(a, rows, count) for a in args),
                      **{k: _copies(v, rows, count) for k, v in kwargs.items()})
                for layer in layers:
                    seen[id(layer)].append(layer.probe_shapes)
    finally:
        context.probing = False
        for layer in layers:
            layer.probe_shapes = None
    moved = []
    for layer in layers:
        small, large = seen[id(layer)]
        layer.layout = batch_dimension(small, large) if small or large else "unknown"
        if layer.layout in (1, None):
            moved.append(layer)
    if moved:
        first = [m for m in moved if m.layout == 1]
        free = [m for m in moved if m.layout is None]
        logger.info("bayesify: %d wrapped layer(s) take their batch in the second dimension "
                    "(a sequence-first layout) and are fed transposed; %d take an input "
                    "without the batch (a table every example shares) and run as the "
                    "network's own", len(first), len(free))
