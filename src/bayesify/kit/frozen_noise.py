"""Frozen noise: a family whose members are "M networks that draw noise through the
``SamplingContext``" exports as a copy of the network whose layers read their
per-member noise from tables recorded once (seeded exactly as at prediction).

Lives in core because ``Method.export_module`` defaults to it; ``bayesify.predict.export``
wraps the result into the exported predictor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.batch import Batch, example_batch, repeat_rows
from bayesify.core.context import SamplingContext, expand_plan_rows
from bayesify.core.method import Method, member_components
from bayesify.core.outputs import logits_of
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


class FrozenNoiseContext(SamplingContext):
    """A sampling context that serves per-member noise from fixed tables.

    The first forward (``recording``) fills ``tables[(layer_id, tail, uniform)]``
    with the ``[M, *tail]`` noise that :meth:`SamplingContext.draw` would give
    (same seed per layer); afterwards every draw is a row gather from a table.
    """

    def __init__(self, source: SamplingContext) -> None:
        super().__init__(source.components)
        self.__dict__.update({k: v for k, v in vars(source).items() if k != "plan"})
        self.tables: dict[tuple[int, tuple[int, ...], bool], torch.Tensor] = {}
        self.recording = True

    def draw(self, layer_id: int, rows: int, tail: tuple[int, ...], device: torch.device,
             *, uniform: bool = False,
             then: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        plan = self.plan
        if plan.member is None:
            raise BayesifyError("a frozen (exported) predictor draws noise per member only")
        key = (layer_id, tuple(int(t) for t in tail), bool(uniform))
        table = self.tables.get(key)
        if table is None:
            if not self.recording:
                raise BayesifyError(
                    f"layer {layer_id} asked for noise of shape {key[1]} that was not drawn "
                    "when the predictor was frozen; the noise shape depends on the input "
                    "size, so export with an example input of the size you will use"
                )
            members = torch.arange(plan.num_members, device=device)
            with self.use(members, deterministic=plan.deterministic, member=members,
                          num_members=plan.num_members, seed=plan.seed):
                table = super().draw(layer_id, plan.num_members, tail, device, uniform=uniform)
            self.tables[key] = table
        if then is not None:  # the recorded noise stays raw: every caller maps its own
            table = then(table)
        return table.index_select(0, expand_plan_rows(plan.member, rows, device))


class FrozenNoiseMembers(nn.Module):
    """``x [B, ...] → [M, B, C]``: one tiled forward of a copy with frozen noise tables.

    Row ``m·B + b`` is example ``b`` seen by member ``m`` (component
    ``member_components[m]``), exactly as ``Method.member_logits`` lays it out.
    """

    def __init__(self, model: nn.Module, context: FrozenNoiseContext,
                 member_components: torch.Tensor, *, seed: int, deterministic: bool) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "context", context)  # not a submodule
        self.register_buffer("member_components", member_components.clone())
        self.seed = int(seed)
        self.deterministic = bool(deterministic)
        self._table_names: dict[tuple[int, tuple[int, ...], bool], str] = {}

    def freeze_tables(self) -> None:
        """Move the recorded tables into buffers (so export stores them as tensors)."""
        for i, (key, table) in enumerate(sorted(self.context.tables.items())):
            name = f"noise_{key[0]}_{i}"
            self.register_buffer(name, table.detach().clone())
            self._table_names[key] = name
        self.context.recording = False

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = Batch(args, kwargs)
        # Batch.size/.tile call int() on the batch size, which would make torch.export
        # specialise it: read and tile the (symbolic) size here instead
        first = next(t for t in batch.tensors() if t.dim() > 0)
        m, b = self.member_components.shape[0], first.shape[0]
        member = torch.arange(m, device=first.device).unsqueeze(1).expand(m, b).reshape(-1)
        component = self.member_components.unsqueeze(1).expand(m, b).reshape(-1)
        if not self.context.recording:
            # read the buffers inside forward so tracing sees them as module state
            self.context.tables = {k: getattr(self, n) for k, n in self._table_names.items()}
        with self.context.use(component, deterministic=self.deterministic, member=member,
                              num_members=m, seed=self.seed):
            logits = logits_of(_tile_rows(batch, m, b).call(self.model))
        return logits.reshape(m, b, logits.shape[-1])


def _tile_rows(batch: Batch, reps: int, rows: Any) -> Batch:
    """``[B, ...]`` → ``[reps·B, ...]`` (row ``r`` is example ``r % B``) for every input
    with ``rows`` leading rows; ``rows`` may be symbolic."""
    if reps == 1:
        return batch

    def tile(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
            return repeat_rows(v, reps)
        return v

    return Batch(tuple(tile(a) for a in batch.args), {k: tile(v) for k, v in batch.kwargs.items()})


def frozen_noise_members(bnn: BayesianModel, *, samples_per_component: int, seed: int,
                         example_input: Any) -> FrozenNoiseMembers:
    """Default :meth:`Method.export_module`: a frozen-noise copy of ``bnn.model``.

    ``example_input``: a tensor, a tuple of inputs, a mapping or a ``Batch``.

    Valid for families that predict with the default ``Method.member_logits``
    and whose layers draw noise only through ``SamplingContext.draw``.
    """
    method = bnn.method
    if type(method).member_logits is not Method.member_logits:
        raise BayesifyError(
            f"method {method.name!r} cannot be exported: it overrides member_logits, so its "
            "prediction is not M noise-frozen copies of the network; the family has to "
            "implement Method.export_module"
        )
    model = copy.deepcopy(bnn.model).eval()
    context = FrozenNoiseContext(bnn.context)
    for module in model.modules():
        if isinstance(module.__dict__.get("context"), SamplingContext):
            object.__setattr__(module, "context", context)
    example = example_batch(example_input)
    members = member_components(method.components, samples_per_component, example.device)
    frozen = FrozenNoiseMembers(model, context, members, seed=seed,
                                deterministic=bnn.context.force_deterministic)
    with torch.no_grad():
        example.call(frozen)  # records every layer's [M, ...] noise table
    frozen.freeze_tables()
    return frozen
