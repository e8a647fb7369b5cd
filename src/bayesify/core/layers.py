"""Base class of every injected layer: keeps the original module as ``base_layer``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.names import in_base_layer
from bayesify.errors import BayesifyError

logger = logging.getLogger(__name__)

#: shape/configuration attributes copied from the wrapped layer (read-only views)
SHAPE_ATTRIBUTES = (
    "in_features", "out_features", "in_channels", "out_channels", "kernel_size", "stride",
    "padding", "dilation", "groups", "padding_mode", "transposed", "output_padding",
    "num_features", "eps", "momentum", "affine", "track_running_stats",
)


#: what a :class:`DescriptionOnly` tensor answers: its dtype, device, shape and the like
_DESCRIBING = frozenset({
    torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__,
    torch.Tensor.__repr__, torch.Tensor.__format__,
})


class DescriptionOnly(torch.Tensor):
    """``wrapper.weight`` / ``.bias`` of a family without one mean tensor (ensembles, iBNN,
    rank-1, …): the pretrained tensor's dtype, device and shape, and an ``AttributeError``
    for any computation with it. Hugging Face's vision models read
    ``projection.weight.dtype`` in their forward to cast the pixels (ViT, DeiT, CLIP, …):
    six families failed on them with the bare error (thirty-first stop), while a forward that
    computed with the pretrained tensor would silently skip the posterior."""

    owner: str = "a Bayesian layer"
    name: str = "weight"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _DESCRIBING:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        view = next((a for a in args if isinstance(a, DescriptionOnly)), None)
        owner, name = (view.owner, view.name) if view is not None else (cls.owner, cls.name)
        raise AttributeError(
            f"{owner} has no single effective {name!r} to compute with (its posterior has no "
            f"mean {name}; {getattr(func, '__name__', func)!s} was called on it); the "
            f"pretrained tensor is .base_layer.{name}")


def describe_only(tensor: torch.Tensor, owner: str, name: str) -> DescriptionOnly:
    """``tensor`` (not copied) as a :class:`DescriptionOnly` view, named for its errors."""
    view = torch.Tensor._make_subclass(DescriptionOnly, tensor.detach(), False)
    view.owner, view.name = owner, name
    return view


class BayesianLayer(nn.Module):
    """Wraps ``base_layer``; subclasses add posterior parameters next to it.

    The wrapper exposes ``base_layer`` and the shape attributes of the wrapped
    layer (:data:`SHAPE_ATTRIBUTES`: ``in_features``, ``out_channels``,
    ``kernel_size`` …) explicitly. ``weight`` / ``bias`` are the *effective mean*
    tensors of the posterior (:meth:`mean_weight`) where a family defines one, and
    otherwise a :class:`DescriptionOnly` view of the pretrained tensor (its dtype, device
    and shape; an ``AttributeError`` for any computation) — never the stale pretrained
    tensor to compute with, which is ``layer.base_layer.weight``.
    """

    #: set at the first forward whose input does not carry the batch (:meth:`__call__`): the
    #: layer runs as the network's own, and an export's member copies keep its weights
    batch_free: bool = False
    #: whether the layer deals the rows of its input to posterior members (the sampling
    #: plan); False where every row of a pass computes alike (SWAG's sampled weights,
    #: Laplace's last layer), which then ignore :attr:`layout`
    deals_rows: bool = True
    #: where the layer's input keeps the batch (:mod:`bayesify.core.layout`): 0, 1 (sequence
    #: first), None (no batch), "unknown" (the probe could not tell) or "unprobed"
    layout: int | str | None = "unprobed"
    #: the shapes of the layer's inputs while the layout probe runs (None otherwise)
    probe_shapes: list[Any] | None = None
    #: whether the wrapper calls the original layer (its ``__call__``: its forward hooks
    #: run on its whole output); False where it computes with the layer's tensors itself,
    #: and a layer with hooks of its own is then not a target (:func:`walker.hooked`)
    runs_base_hooks: bool = False

    def __init__(self, base_layer: nn.Module, context: SamplingContext) -> None:
        super().__init__()
        self.base_layer = base_layer
        # a plain attribute (not a submodule): shared by every layer of one model
        object.__setattr__(self, "context", context)
        self.layer_id = context.next_layer_id()
        for attr in SHAPE_ATTRIBUTES:
            if attr in base_layer.__dict__ and not hasattr(type(self), attr):
                object.__setattr__(self, attr, base_layer.__dict__[attr])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's forward where its input keeps the batch in front; else as its
        :attr:`layout` says (found by :mod:`bayesify.core.layout`'s probe):

        * batch in the second dimension (``[length, batch, …]``: ``nn.TransformerEncoder``
          with ``batch_first=False``, XLNet): fed transposed, its output transposed back;
        * no batch (a table every example shares: Swin V2's continuous position bias MLP on
          its coordinate table — Hugging Face's ``continuous_position_bias_mlp``, timm's
          and torchvision's ``cpb_mlp``): the network's own layer (its output is added to
          every example, so it cannot differ per member; :attr:`batch_free`). Where no probe
          ran (a traced first forward), an input of one row under a plan of several is taken
          as such a table, logged once per layer.

        Before the thirty-sixth stop every family that deals rows to members stopped at
        both ("a wrapped layer received 1 rows but the sampling plan has 64")."""
        if not self.deals_rows:
            return super().__call__(*args, **kwargs)
        first = args[0] if args else None
        if self.probe_shapes is not None:  # the layout probe's pass: record, compute as the network
            self.probe_shapes.append(first.shape if isinstance(first, torch.Tensor) else None)
            return self.base_layer(*args, **kwargs)
        layout = self.layout
        if layout is None or (layout in ("unprobed", "unknown") and self._batch_free(first)):
            self.batch_free = True
            return self.base_layer(*args, **kwargs)
        if layout == 1 and isinstance(first, torch.Tensor) and first.dim() >= 2:
            out = super().__call__(first.transpose(0, 1), *args[1:], **kwargs)
            return out.transpose(0, 1).contiguous()
        return super().__call__(*args, **kwargs)

    def _batch_free(self, first: Any) -> bool:
        """Whether ``first`` (the input) has one row where the active plan has several."""
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            return False
        rows = first.shape[0]
        if not isinstance(rows, int) or rows != 1:  # a traced (symbolic) batch is a batch
            return False
        planned = self.context.planned_rows()
        if planned is None or (isinstance(planned, int) and planned <= 1):
            return False  # (a traced plan is a batch of two or more, unguarded)
        if not self.batch_free:
            logger.info("%s (layer %d) receives an input that does not carry the batch (1 row "
                        "where the sampling plan has %d, e.g. a position-bias table every "
                        "example shares): it runs as the network's own layer, without a "
                        "posterior; exclude it (exclude=[...]) to drop its posterior "
                        "parameters", type(self).__name__, self.layer_id, planned)
        return True

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name in ("weight", "bias"):
            base = getattr(self.base_layer, name, None)
            if isinstance(base, torch.Tensor):
                return describe_only(base, type(self).__name__, name)
            if base is None and hasattr(self.base_layer, name):
                return None  # a layer without a bias
            raise AttributeError(
                f"{type(self).__name__} has no single effective {name!r} (its posterior has "
                f"no mean {name}); the pretrained tensor is .base_layer.{name}"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} "
                             "(the wrapped layer is .base_layer)")

    @property
    def weight(self) -> torch.Tensor:
        """Effective mean weight of the posterior (see :meth:`mean_weight`)."""
        return self.mean_weight("weight")

    @property
    def bias(self) -> torch.Tensor | None:
        """Effective mean bias of the posterior (see :meth:`mean_weight`)."""
        return self.mean_weight("bias")

    def mean_weight(self, name: str) -> torch.Tensor | None:
        """The posterior-mean value of the base tensor ``name`` ('weight'/'bias').

        Families whose mean network is well defined override this; the default
        raises ``AttributeError`` so a parent that reads ``child.weight`` fails
        loudly instead of using a tensor the wrapper does not compute with.
        """
        raise AttributeError(name)

    def posterior_parameters(self) -> list[nn.Parameter]:
        """Parameters this layer adds (everything but ``base_layer``'s)."""
        return [p for n, p in self.named_parameters() if not in_base_layer(n)]

    def kl(self) -> torch.Tensor:
        """KL(q‖p) of this layer's posterior, summed (0 for non-variational families)."""
        p = self.posterior_parameters()
        device = p[0].device if p else self.base_layer_device()
        return torch.zeros((), device=device)

    def base_layer_device(self) -> torch.device:
        for p in self.base_layer.parameters():
            return p.device
        return torch.device("cpu")

    def num_nodes(self) -> int:
        """Number of noise variables per component (family-specific)."""
        return 0

    def extra_repr(self) -> str:
        return f"posterior_values={sum(p.numel() for p in self.posterior_parameters())}"


def channel_axis(module: nn.Module) -> int:
    """Axis of the input that holds channels/features: 1 for conv, -1 for linear."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return 1
    return -1


def in_channels(module: nn.Module) -> int:
    if isinstance(module, nn.modules.conv._ConvNd):
        return module.in_channels
    if isinstance(module, nn.Linear):
        return module.in_features
    raise TypeError(f"no input-channel count for {type(module).__name__}")


def out_channels(module: nn.Module) -> int:
    if isinstance(module, nn.modules.conv._ConvNd):
        return module.out_channels
    if isinstance(module, nn.Linear):
        return module.out_features
    raise TypeError(f"no output-channel count for {type(module).__name__}")


def broadcast_rows(values: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """Reshape per-row, per-channel ``values [R, C]`` to broadcast against ``x``.

    Conv input ``[R, C, *spatial]`` → ``[R, C, 1, ...]`` (shared over pixels);
    linear input ``[R, *tokens, C]`` → ``[R, 1, ..., C]`` (shared over tokens).
    """
    rows, chans = values.shape
    dim = axis if axis >= 0 else x.dim() + axis
    if x.dim() < 2 or dim >= x.dim() or x.shape[dim] != chans:
        got = "no such axis" if x.dim() < 2 or dim >= x.dim() else x.shape[dim]
        raise BayesifyError(
            f"the layer's posterior noise has {chans} channels, but its input of shape "
            f"{tuple(x.shape)} has {got} along axis {axis}: the input does not fit the "
            f"layer (e.g. a 1-channel image fed to a 3-channel model); the plain layer "
            f"expects {chans} {'channels at axis 1' if axis == 1 else 'features last'}"
        )
    if axis == 1:
        return values.view(rows, chans, *([1] * (x.dim() - 2)))
    return values.view(rows, *([1] * (x.dim() - 2)), chans)


def concatenated_kl(layers: list[Any], *, key: Callable[[Any], tuple],
                    parts: Callable[[Any], tuple[list[torch.Tensor], list[torch.Tensor]]],
                    kl: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Σ ``layer.kl()`` over ``layers`` as one computation, for a KL that is a sum over nodes:
    ``kl(first, cat(means), cat(rhos))`` with ``parts(layer) = (means, rhos)`` concatenated
    along the node axis (dim 1), when every layer has the same ``key`` (components, prior,
    device...); else layer by layer. Per-layer KLs cost ~10 small kernels each way per layer,
    a large share of a deep network's training step on a GPU."""
    first = layers[0]
    if len(layers) == 1 or any(key(layer) != key(first) for layer in layers):
        return torch.stack([layer.kl().float() for layer in layers]).sum()
    means = [t for layer in layers for t in parts(layer)[0]]
    rhos = [t for layer in layers for t in parts(layer)[1]]
    return kl(first, torch.cat(means, 1), torch.cat(rhos, 1))


def find_batch_free(bnn: Any, example_input: Any) -> dict[str, BayesianLayer]:
    """The wrapped layers of ``bnn`` whose input does not carry the batch
    (:attr:`BayesianLayer.batch_free`, or so found by the layout probe), after one predictive
    pass on ``example_input`` where no planned forward has run yet: an export's member copies
    keep their network weights, as the in-process members do."""
    layers = bnn.bayesian_layers()
    if not bnn.context.layout_probed and not any(layer.batch_free for layer in layers.values()):
        inputs = getattr(example_input, "model_input", None)  # a Batch: its inputs
        with torch.no_grad():
            bnn.predictive(inputs() if callable(inputs) else example_input,
                           samples_per_component=1)
    return {name: layer for name, layer in layers.items()
            if layer.batch_free or layer.layout is None}
