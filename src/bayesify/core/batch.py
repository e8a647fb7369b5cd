"""One batch convention for every entry point (fit, predictor, calibrate, evaluate,
acquisition, report, export).

A loader may yield

- a tensor ``x`` (inputs only);
- a pair ``(x, y)``;
- a mapping (Hugging Face style): the label under ``labels`` (or ``label``); a single
  input under ``image``/``img``/``pixel_values`` is passed positionally (``model(x)``),
  other entries as keyword arguments (a key the model's ``forward`` does not take, or a
  label under another name such as ``y``, is refused with a ``batch_fn`` example);
- anything else, when the caller passes ``batch_fn(batch) -> (inputs, labels)``
  where ``inputs`` is a tensor, a tuple of positional inputs or a mapping of
  keyword inputs and ``labels`` a tensor or ``None``.

Longer tuples ``(x1, x2, y)`` are refused unless a ``batch_fn`` says how to split
them: guessing which entry is the label silently trains on an attention mask.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bayesify.core import layout
from bayesify.core.names import BASE_LAYER
from bayesify.errors import BayesifyError

LABEL_KEYS = ("labels", "label")
BatchFn = Callable[[Any], tuple[Any, Any]]


@dataclass(frozen=True)
class Batch:
    """Model inputs (``args``/``kwargs``) and labels ``[B]`` (or ``None``) of one batch."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    labels: torch.Tensor | None = None

    # -- shape -----------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return [v for v in (*self.args, *self.kwargs.values()) if isinstance(v, torch.Tensor)]

    @property
    def size(self) -> int:
        """Rows B: the leading size of the first input tensor."""
        for t in self.tensors():
            if t.dim() > 0:
                return int(t.shape[0])
        raise BayesifyError("the batch holds no input tensor with a batch dimension")

    @property
    def device(self) -> torch.device:
        for t in self.tensors():
            return t.device
        return torch.device("cpu")

    # -- transforms ------------------------------------------------------------------
    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], *, labels: bool = True) -> Batch:
        """Apply ``fn`` to every input tensor with the batch's leading size (and the labels)."""
        rows = self.size

        def apply(v: Any) -> Any:
            return fn(v) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v

        return Batch(tuple(apply(a) for a in self.args), {k: apply(v) for k, v in self.kwargs.items()},
                     fn(self.labels) if labels and self.labels is not None else self.labels)

    def to(self, device: torch.device | str, *, channels_last: bool = False,
           non_blocking: bool = False) -> Batch:
        def move(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            v = v.to(device, non_blocking=non_blocking)
            if channels_last and v.dim() == 4 and v.is_floating_point():
                v = v.contiguous(memory_format=torch.channels_last)
            return v

        return Batch(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()},
                     None if self.labels is None else self.labels.to(device, non_blocking=non_blocking))

    def tile(self, reps: int) -> Batch:
        """``[B, ...]`` → ``[reps·B, ...]`` in blocks (row ``r`` is example ``r % B``), labels too."""
        if reps == 1:
            return self
        return self.map(lambda t: repeat_rows(t, reps))

    def rows(self, index: slice | torch.Tensor) -> Batch:
        return self.map(lambda t: t[index])

    def inputs_only(self) -> Batch:
        return Batch(self.args, self.kwargs, None)

    def model_input(self) -> Any:
        """What the families' forward helpers take: the tensor itself for a single
        positional input, else this batch without labels."""
        if len(self.args) == 1 and not self.kwargs and isinstance(self.args[0], torch.Tensor):
            return self.args[0]
        return self.inputs_only()

    # -- calling -----------------------------------------------------------------------
    def call(self, model: nn.Module | Callable[..., Any]) -> Any:
        """``model(*args, **kwargs)`` with the inputs in the model's dtype (see
        :func:`model_ready`); keyword inputs the model's ``forward`` does not take are
        refused first (:func:`check_keywords`)."""
        if self.kwargs:
            check_keywords(model, self)
        args, kwargs = model_ready(model, self.args, self.kwargs)
        return _calling(model, args, kwargs)

    def require_labels(self, where: str) -> torch.Tensor:
        if self.labels is None:
            raise BayesifyError(
                f"{where} needs labels, but the batch has none: yield (x, y) pairs, a mapping "
                f"with a 'labels' entry, or pass batch_fn=... returning (inputs, labels)"
            )
        return self.labels


#: integer label types taken as class indices and widened to ``int64`` (torch's losses
#: take only ``long`` targets: int32 labels from NumPy or a dataset crashed the training
#: step with "expected target dtype to be Long", thirty-first stop)
_NARROW_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.uint8)


def _check_labels(labels: Any) -> torch.Tensor | None:
    if labels is None:
        return None
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    if labels.dtype in _NARROW_INTEGERS:
        labels = labels.long()
    return labels


def _as_batch(inputs: Any, labels: Any) -> Batch:
    if isinstance(inputs, Batch):
        return Batch(inputs.args, inputs.kwargs, _check_labels(labels))
    if isinstance(inputs, Mapping):
        return Batch((), dict(inputs), _check_labels(labels))
    if isinstance(inputs, (tuple, list)):
        return Batch(tuple(inputs), {}, _check_labels(labels))
    return Batch((inputs,), {}, _check_labels(labels))


def split_batch(batch: Any, batch_fn: BatchFn | None = None) -> Batch:
    """The :class:`Batch` of whatever a loader yielded (see the module docstring)."""
    if isinstance(batch, Batch):
        return batch
    if batch_fn is not None:
        out = batch_fn(batch)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise BayesifyError(
                f"batch_fn must return (inputs, labels); it returned a {type(out).__name__}"
            )
        return _as_batch(out[0], out[1])
    if isinstance(batch, torch.Tensor):
        return Batch((batch,), {}, None)
    if isinstance(batch, Mapping):
        return _mapping_batch(batch)
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return Batch((batch[0],), {}, None)
        if len(batch) == 2:
            return _as_batch(batch[0], batch[1])
        raise BayesifyError(
            f"the loader yields tuples of {len(batch)} items; bayesify takes (x, y) pairs or "
            "mappings with 'labels'. Say how to split longer tuples with batch_fn=..., e.g. "
            "batch_fn=lambda b: ({'input_ids': b[0], 'attention_mask': b[1]}, b[2])"
        )
    raise BayesifyError(
        f"cannot read a batch of type {type(batch).__name__}; yield a tensor, (x, y), a mapping "
        "with 'labels', or pass batch_fn=... returning (inputs, labels)"
    )


#: keys of a mapping batch whose single input is an image tensor (🤗 datasets' image sets,
#: torchvision-style dicts): passed to the model positionally, ``model(x)``
IMAGE_KEYS = ("image", "img", "pixel_values")
#: keys that usually hold labels under another name: a mapping with one of them and no
#: ``labels``/``label`` is refused rather than passed to the model as a keyword argument
LABEL_LIKE_KEYS = ("y", "target", "targets", "class", "label_id", "label_ids")


def _mapping_help(keys: list[str]) -> str:
    labels = [k for k in keys if k.lower() in (*LABEL_KEYS, *LABEL_LIKE_KEYS)]
    label = labels[0] if labels else "labels"
    inputs = [k for k in keys if k != label] or keys
    return (f"a mapping batch must hold its label under 'labels' or 'label' and its inputs "
            f"either under one of {list(IMAGE_KEYS)} (an image tensor, passed as model(x)) or "
            f"under the model's keyword argument names (e.g. 'input_ids', 'attention_mask'); "
            f"this one holds {keys}. Say how to split it with batch_fn=..., e.g. "
            f"batch_fn=lambda b: (b[{inputs[0]!r}], b[{label!r}])")


def _mapping_batch(batch: Mapping) -> Batch:
    """The :class:`Batch` of a mapping: the label under ``labels``/``label``; a single
    input under an :data:`IMAGE_KEYS` key positional, anything else keyword arguments."""
    inputs = dict(batch)
    labels = None
    for key in LABEL_KEYS:
        if key in inputs:
            labels = inputs.pop(key)
            break
    if not inputs:
        raise BayesifyError(f"the batch mapping holds only labels ({sorted(batch)}); "
                            "no model inputs are left")
    keys = [str(k) for k in batch]
    if labels is None and any(str(k).lower() in LABEL_LIKE_KEYS for k in inputs):
        raise BayesifyError(_mapping_help(keys))
    if len(inputs) == 1:
        (key, value), = inputs.items()
        if isinstance(key, str) and key in IMAGE_KEYS:
            return Batch((value,), {}, _check_labels(labels))
    return Batch((), inputs, _check_labels(labels))


def check_keywords(model: Any, batch: Batch) -> None:
    """Refuse a mapping batch whose keys the model's ``forward`` does not take (instead of
    torch's ``forward() got an unexpected keyword argument``), naming the keys, what a
    mapping must hold and a ``batch_fn=`` example."""
    if not batch.kwargs:
        return
    import inspect

    try:
        params = inspect.signature(model.forward if isinstance(model, nn.Module) else model).parameters
    except (TypeError, ValueError):  # builtins, scripted modules: nothing to compare
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in batch.kwargs if k not in params]
    if unknown:
        name = type(model).__name__
        raise BayesifyError(f"{name}.forward() takes no argument {unknown[0]!r}: "
                            + _mapping_help([*batch.kwargs, *([] if batch.labels is None
                                                              else ["label"])]))


def as_inputs(*args: Any, **kwargs: Any) -> Batch:
    """A :class:`Batch` from a call ``predictor(x)``, ``predictor(**inputs)``,
    ``predictor(mapping)`` or ``predictor(batch)`` (labels in a mapping are dropped)."""
    if not args and kwargs:
        return Batch((), dict(kwargs), None)
    if len(args) == 1 and not kwargs:
        arg = args[0]
        if isinstance(arg, Batch):
            return arg.inputs_only()
        if isinstance(arg, Mapping):
            return split_batch(arg).inputs_only()
        if isinstance(arg, torch.Tensor):
            return Batch((arg,), {}, None)
    return Batch(tuple(args), dict(kwargs), None)


def iter_batches(loader: Any, *, device: torch.device | str | None = None,
                 batch_fn: BatchFn | None = None, channels_last: bool = False):
    """:class:`Batch` objects of ``loader``, moved to ``device``."""
    for raw in loader:
        batch = split_batch(raw, batch_fn)
        yield batch if device is None else batch.to(device, channels_last=channels_last,
                                                    non_blocking=True)


def example_batch(example: Any) -> Batch:
    """The inputs-only :class:`Batch` of an export example (tensor, tuple or mapping)."""
    if isinstance(example, Batch):
        batch = example.inputs_only()
    elif isinstance(example, torch.Tensor):
        batch = Batch((example,), {}, None)
    elif isinstance(example, Mapping):
        batch = as_inputs(example)
    elif isinstance(example, (tuple, list)):
        batch = Batch(tuple(example), {}, None)
    else:
        raise TypeError(
            f"export needs an example input: a tensor [B, ...], a tuple of input tensors or a "
            f"mapping such as {{'input_ids': ..., 'attention_mask': ...}}; got "
            f"{type(example).__name__}"
        )
    if not batch.tensors():
        raise BayesifyError("the export example holds no tensor input")
    for key in batch.kwargs:
        if not (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)
                and key != "self"):
            raise BayesifyError(
                f"export input name {key!r} is not a valid Python identifier; rename the "
                "mapping's keys (the exported program takes them as keyword arguments)"
            )
    _ = batch.size  # raises when no input has a batch dimension
    return batch


def tile(x: Any, reps: int) -> Any:
    """``[B, ...]`` → ``[reps·B, ...]`` in blocks: row ``r`` is example ``r % B``.

    ``x`` is a tensor or a :class:`Batch` (every input tiled)."""
    if reps == 1:
        return x
    if isinstance(x, Batch):
        return x.tile(reps)
    return repeat_rows(x, reps)


def repeat_rows(t: torch.Tensor, reps: int) -> torch.Tensor:
    """``t`` stacked ``reps`` times along the rows, in its own memory format.

    ``Tensor.repeat`` returns a contiguous (NCHW) tensor even for a channels_last input: a
    tiled CNN step then ran every layer on NCHW activations against channels_last weights,
    one activation-sized layout conversion per convolution and the slow generic BatchNorm
    backward (measured on an H100: ≈ 10 ms each of an iBNN ResNet-50 step). ``torch.cat``
    keeps the input's layout; the values are the same."""
    if t.dim() == 0:
        return t.repeat(reps)
    return torch.cat([t] * reps, dim=0)


def call_model(model: Any, inputs: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*args, **kwargs)`` for a :class:`Batch`
    (floating inputs in the model's dtype, integer images refused: :func:`model_ready`)."""
    if isinstance(inputs, Batch):
        return inputs.call(model)
    (x,), _ = model_ready(model, (inputs,), {})
    return _calling(model, (x,), {})


# -- input dtypes -------------------------------------------------------------------------
def model_dtype(model: Any) -> torch.dtype | None:
    """The dtype of the model's first floating parameter of the user's network (``None``: no
    such parameter, or not a module). A wrapper's own posterior parameters (rank-one factors
    in float32 beside a float64 network's weights) come first in its module but are not what
    the network computes in; they count only where nothing else is floating."""
    if not isinstance(model, nn.Module):
        return None
    fallback = None
    for module in model.modules():  # pre-order: a wrapper, then its base layer
        wrapper = hasattr(module, BASE_LAYER)  # its own parameters are the posterior's
        for p in module.parameters(recurse=False):
            if not p.is_floating_point():
                continue
            if wrapper:
                fallback = fallback or p.dtype
                continue
            return p.dtype  # called on every forward: the first one ends the walk
    return fallback


def _integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _conversion_hint(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> str:
    computes = f"the model computes in {dtype}" if dtype is not None else "the model takes floats"
    return (f"{name} is a {t.dtype} tensor of shape {list(t.shape)} (integer images or "
            f"features?) but "
            f"{computes}: convert the images as the model was trained, e.g. "
            "x.float() / 255 for 0–255 pixels followed by the model's normalisation, or the "
            "recorded preprocessing (bayesify.predict.preprocessing.apply_preprocessing, the "
            "model's own transforms); integer token ids go to a model that embeds them")


def model_ready(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs as ``model`` takes them: floating tensors (float64, float16, …) in the
    model's own floating dtype; ``uint8`` tensors (images as decoded, never token ids)
    refused with how to convert them, before torch fails on them with a dtype error deep
    inside the network. Other integer tensors go through (token ids ``[B, T]``, also
    ``[B, choices, T]``); a dtype error they cause becomes the same advice
    (:func:`_calling`)."""
    dtype = model_dtype(model)

    def ready(name: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if v.dtype == torch.uint8:
            raise BayesifyError(_conversion_hint(name, v, dtype))
        if dtype is not None and v.is_floating_point() and v.dtype != dtype:
            return v.to(dtype)
        return v

    return (tuple(ready(f"input {i}" if len(args) > 1 else "the input", a)
                  for i, a in enumerate(args)),
            {k: ready(f"input {k!r}", v) for k, v in kwargs.items()})


_DTYPE_ERROR = ("dtype", "scalar type", "should be the same", "not implemented for")


def call_with(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``model(*args, **kwargs)`` with the dtype handling of :func:`model_ready`."""
    args, kwargs = model_ready(model, args, kwargs)
    return _calling(model, args, kwargs)


def _calling(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``model(*args, **kwargs)``; a dtype error from integer inputs becomes a
    :class:`BayesifyError` saying how to convert them. A bayesified network's first call
    under a sampling plan probes its layers' layouts first (:mod:`bayesify.core.layout`)."""
    layout.before_call(model, args, kwargs)
    try:
        return model(*args, **kwargs)
    except RuntimeError as err:
        integers = [(name, v) for name, v in (*enumerate(args), *kwargs.items())
                    if isinstance(v, torch.Tensor) and _integer(v)]
        if integers and any(text in str(err) for text in _DTYPE_ERROR):
            name, t = integers[0]
            where = (f"input {name!r}" if isinstance(name, str) else
                     "the input" if len(args) == 1 and not kwargs else f"input {name}")
            raise BayesifyError(_conversion_hint(where, t, model_dtype(model))
                                + f" (torch said: {str(err).splitlines()[0]})") from err
        raise


def batch_rows(inputs: Any) -> int:
    """B: rows of a tensor ``[B, ...]`` or of a :class:`Batch`."""
    return inputs.size if isinstance(inputs, Batch) else int(inputs.shape[0])


def batch_device(inputs: Any) -> torch.device:
    return inputs.device


def limited_batches(loader: Any, *, fraction: float, device: torch.device | str | None = None,
                    batch_fn: BatchFn | None = None):
    """Inputs-only :class:`Batch` es of the first ``ceil(fraction · len(loader))`` batches
    of ``loader`` (all of them when its length is unknown)."""
    try:
        limit = max(1, math.ceil(fraction * len(loader)))  # type: ignore[arg-type]
    except TypeError:
        limit = None
    for i, batch in enumerate(iter_batches(loader, device=device, batch_fn=batch_fn)):
        if limit is not None and i >= limit:
            break
        yield batch.inputs_only()


#: the global RNG's seed while :func:`replayed_order` draws a loader's batches
ORDER_SEED = 0


def rng_devices(device: torch.device | str | None) -> list[int]:
    """The CUDA device whose RNG ``torch.random.fork_rng`` must also keep (none on CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    return [device.index or 0] if device.type == "cuda" else []


def replayed_order(batches: Iterable[Batch], loader: Any,
                   device: torch.device | str | None = None) -> Iterator[Batch]:
    """``batches`` (an iterator over ``loader`` not started yet) drawn in the same order at
    every call: the loader's own ``generator`` (a shuffling ``DataLoader`` given one) is
    seeded with :data:`ORDER_SEED` while the batches are drawn and put back to its state
    afterwards, and the global RNG (a ``DataLoader`` without one draws its order and worker
    seeds from it) is forked and seeded the same way and restored after. For passes whose
    result should depend on the model alone, not on how many passes came before: SWAG's
    BatchNorm statistics of a sampled network (a shuffled pass changes the batches'
    composition, hence the statistics of every BatchNorm after the first; the validation
    search scored one SWAG scale 0.001–0.002 nats apart depending on which scales it had
    scored first, as much as its feasibility margin). (Put back but not seeded, the order
    followed whatever pass had advanced the generator last: the Laplace heads' curvature
    pass over the training loader came between the search's statistics and a fresh
    recomputation, which then predicted up to 0.66 nats apart on the CNN protocol's seed 0.)"""
    generator = getattr(loader, "generator", None)
    state = generator.get_state() if isinstance(generator, torch.Generator) else None
    try:
        if state is not None:
            generator.manual_seed(ORDER_SEED)
        with torch.random.fork_rng(devices=rng_devices(device)):
            torch.manual_seed(ORDER_SEED)
            yield from batches
    finally:
        if state is not None:
            generator.set_state(state)
