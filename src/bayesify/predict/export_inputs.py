"""Named inputs of an exported predictor: what ``export(path, example)`` traces.

The example may be a tensor ``x [B, ...]``, a tuple of positional inputs or a
mapping of keyword inputs (Hugging Face ``{"input_ids", "attention_mask", ...}``;
a ``labels`` entry is dropped). The exported program takes the same inputs under
the same names: one tensor → ``x``; positional tuple → ``input_0, input_1, ...``;
a mapping → its keys. Axis 0 of every input with the example's batch size is
dynamic; so is axis 1 of integer token inputs ``[B, N]`` (and of any ``[B, N]``
input beside them, e.g. a float attention mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bayesify.core.batch import Batch, as_inputs, example_batch  # noqa: F401 - re-exported
from bayesify.errors import BayesifyError

#: the one positional input of a tensor example keeps the historic name ``x``
SINGLE_INPUT_NAME = "x"


@dataclass(frozen=True)
class InputLayout:
    """Which entries of the example are graph inputs, under which names.

    ``names``: one per tensor input, positional inputs first; ``positions[i]`` is
    the index in ``args`` or the key in ``kwargs`` of ``names[i]``; ``constants``
    are non-tensor keyword entries baked into the program.
    """

    names: tuple[str, ...]
    positions: tuple[int | str, ...]
    num_args: int
    constants: dict[str, Any]

    @classmethod
    def of(cls, batch: Batch) -> InputLayout:
        names: list[str] = []
        positions: list[int | str] = []
        for i, value in enumerate(batch.args):
            if not isinstance(value, torch.Tensor):
                raise BayesifyError(
                    f"positional export input {i} is a {type(value).__name__}; export takes "
                    "tensor inputs (pass constants as keyword entries of a mapping)"
                )
            names.append(SINGLE_INPUT_NAME if len(batch.args) == 1 else f"input_{i}")
            positions.append(i)
        constants = {}
        for key, value in batch.kwargs.items():
            if isinstance(value, torch.Tensor):
                names.append(key)
                positions.append(key)
            else:
                constants[key] = value
        return cls(tuple(names), tuple(positions), len(batch.args), constants)

    def tensors(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The graph inputs of ``batch`` in ``names`` order."""
        return tuple(batch.args[p] if isinstance(p, int) else batch.kwargs[p] for p in self.positions)

    def call_inputs(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """``(args, kwargs)`` of the named forward: positional inputs stay positional,
        mapping entries become keyword arguments (so the program is called the same way)."""
        tensors = self.tensors(batch)
        args = tensors[:self.num_args]
        kwargs = dict(zip(self.names[self.num_args:], tensors[self.num_args:]))
        return args, kwargs

    def batch(self, tensors: tuple[Any, ...]) -> Batch:
        """Inverse of :meth:`tensors`: the model call's ``args`` / ``kwargs``."""
        args: list[Any] = [None] * self.num_args
        kwargs: dict[str, Any] = {}
        for position, value in zip(self.positions, tensors):
            if isinstance(position, int):
                args[position] = value
            else:
                kwargs[position] = value
        kwargs.update(self.constants)
        return Batch(tuple(args), kwargs, None)


def widen_example(batch: Batch) -> Batch:
    """torch.export specialises sizes 0/1: trace with at least two rows (and tokens)."""
    rows = batch.size
    if rows < 2:
        batch = batch.map(lambda t: t[:1].expand(2, *t.shape[1:]).contiguous())
    return batch


def dynamic_shapes(layout: InputLayout, batch: Batch) -> dict[str, dict[int, Any]]:
    """Per input ``{0: batch}`` plus ``{1: seq}`` for token inputs ``[B, N]`` (N ≥ 2)."""
    rows = batch.size
    tensors = layout.tensors(batch)
    token_lengths = {int(t.shape[1]) for t in tensors
                     if t.dim() == 2 and t.shape[0] == rows and not t.is_floating_point()
                     and not t.is_complex() and t.dtype != torch.bool and t.shape[1] >= 2}
    batch_dim = torch.export.Dim("batch", min=1)
    seq_dims = {n: torch.export.Dim.AUTO for n in token_lengths}
    shapes: dict[str, dict[int, Any]] = {}
    for name, t in zip(layout.names, tensors):
        spec: dict[int, Any] = {}
        if t.dim() > 0 and t.shape[0] == rows:
            spec[0] = batch_dim
            if t.dim() == 2 and int(t.shape[1]) in seq_dims:
                spec[1] = seq_dims[int(t.shape[1])]
        shapes[name] = spec
    return shapes


def named_input_module(inner: nn.Module, layout: InputLayout) -> nn.Module:
    """``inner`` behind a ``forward`` whose parameters are exactly ``layout.names``.

    torch.export records the forward's signature, so the saved program is called
    as ``module(input_ids=..., attention_mask=...)`` (or positionally), and ONNX
    inputs carry the same names.
    """
    params = ", ".join(layout.names)
    source = f"def forward(self, {params}):\n    return self._run(({params},))\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<bayesify.export>", "exec"), namespace)  # noqa: S102 - names are checked identifiers
    cls = type("NamedInputsPredictor", (_NamedInputs,), {"forward": namespace["forward"]})
    return cls(inner, layout)


class _NamedInputs(nn.Module):
    def __init__(self, inner: nn.Module, layout: InputLayout) -> None:
        super().__init__()
        self.inner = inner
        self.layout = layout

    def _run(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        batch = self.layout.batch(tensors)
        return self.inner(*batch.args, **batch.kwargs)
