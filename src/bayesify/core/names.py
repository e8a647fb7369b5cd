"""The one place mapping base-model names to posterior tensor names and back.

Every injected layer keeps the original module as ``base_layer``, so inside the wrapped
model the pretrained tensor ``layer1.0.conv1.weight`` is ``layer1.0.conv1.base_layer.weight``
and the posterior tensors of that layer are ``layer1.0.conv1.<local name>`` (e.g.
``layer1.0.conv1.mean``). Saved posteriors, checkpoints, exports and
``torch.func.functional_call`` keys all go through these functions.
"""

from __future__ import annotations

BASE_LAYER = "base_layer"
_SEGMENT = f".{BASE_LAYER}."


def base_name(name: str) -> str:
    """A name in the wrapped model → the base model's name: every ``base_layer`` segment
    removed (``"fc.base_layer.weight"`` → ``"fc.weight"``, ``"fc.base_layer"`` → ``"fc"``)."""
    parts = [p for p in name.split(".") if p != BASE_LAYER]
    return ".".join(parts)


def wrapped_name(layer: str, tensor: str) -> str:
    """The base module's ``tensor`` of the injected layer ``layer`` in the wrapped model
    (``("fc", "weight")`` → ``"fc.base_layer.weight"``; a functional_call key)."""
    return f"{layer}{_SEGMENT}{tensor}" if layer else f"{BASE_LAYER}.{tensor}"


def in_base_layer(local: str) -> bool:
    """Whether a layer-local tensor name (``named_parameters`` / ``named_buffers`` of an
    injected layer) belongs to the wrapped base module rather than to the posterior."""
    return local == BASE_LAYER or local.startswith(f"{BASE_LAYER}.") or _SEGMENT in f".{local}"


def posterior_name(layer: str, local: str) -> str:
    """The saved name of a posterior tensor: the layer's base-model name + its local name."""
    return f"{layer}.{local}" if layer else local


def flat_key(name: str) -> str:
    """A dotted parameter name as a ``ParameterDict`` / buffer key (``"a.b"`` → ``"a__b"``)."""
    return name.replace(".", "__")


def dotted(key: str) -> str:
    """:func:`flat_key` undone (``"a__b"`` → ``"a.b"``)."""
    return key.replace("__", ".")
