"""The one predictive-scale knob of a gradient-trained family, held in ``bnn.state``.

Each family names one knob with a plain meaning and registers it in ``prepare``
(:func:`add_knob`): a multiplier of the learned posterior std / noise (ibnn, rank1,
meanfield, hypernet; 0 is the mean network), a multiplier of the dropout rate
(dropout; 0 is the deterministic network) or a temperature of the members' logits
(batchensemble, ensemble; bounded grid, never T → 0). The knob is 1 while training
(layers read it only in eval mode, :func:`knob_value`), is reset to 1 by
``begin_fit`` and, when ``fit`` is given a ``val_loader``, is chosen by the shared
validation search (:func:`tune_knob` → :func:`bayesify.core.selection.select_on_validation`)
from the family's ``finish_fit``. Being a buffer of ``bnn.state`` it is saved,
loaded and checkpointed with the posterior, so a reloaded posterior predicts
exactly as the tuned one; layers read it inside their forward, so export (which
runs the layers with frozen noise) applies it too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger("bayesify")

#: multipliers of a learned std / rate: 0 (the mean network) … 2 (twice the spread)
SPREAD_GRID: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
#: member-logit temperatures: bounded, and never below 1 — a small or perfectly
#: classified validation set rewards sharpening (T → 0 unbounded), which is
#: catastrophic under shift (T = 0.5–0.7 chosen on digits doubled the NLL under noise)
TEMPERATURE_GRID: tuple[float, ...] = (1.0, 1.25, 1.5, 2.0, 3.0)

_SOURCE = "_predictive_knob"


def add_knob(bnn: BayesianModel, name: str, *, layers: Iterable[nn.Module] = ()) -> None:
    """Register the knob ``name`` (value 1) in ``bnn.state`` and let ``layers`` read it.

    The layers keep a plain (non-module) reference to ``bnn.state`` and the name,
    so moving the model between devices keeps them pointing at the live buffer.
    """
    bnn.state.add(name, torch.ones((), dtype=torch.float64))
    for layer in layers:
        object.__setattr__(layer, _SOURCE, (bnn.state, name))


def knob_value(layer: nn.Module) -> torch.Tensor | float:
    """The knob a layer applies now: 1 in training mode or when none is attached,
    else the ``[]`` buffer of ``bnn.state``."""
    source = layer.__dict__.get(_SOURCE)
    if source is None or layer.training:
        return 1.0
    state, name = source
    return state.get_buffer(name)


def knob_float(layer: nn.Module) -> float:
    """:func:`knob_value` as a Python float (for layers that branch on it)."""
    value = knob_value(layer)
    return float(value) if isinstance(value, torch.Tensor) else value


def reset_knob(bnn: BayesianModel, name: str) -> None:
    """Back to 1 (the trained posterior itself): called from ``begin_fit``."""
    bnn.state.set(name, 1.0)


def tune_knob(
    bnn: BayesianModel,
    val_loader: Iterable | None,
    *,
    name: str,
    grid: tuple[float, ...] | list[float],
    meaning: str,
    batch_fn: Any = None,
) -> dict[str, Any]:
    """Choose the knob on ``val_loader`` (shared search, one-SE rule, broadest value).

    Returns the record that lands in ``fit``'s history: ``{name, name_grid,
    name_val_nll}``; an empty record (knob left at 1) without a validation loader.
    """
    if val_loader is None:
        return {}
    from bayesify.core.selection import select_on_validation

    was_training = bnn.training
    bnn.eval()
    try:
        record = select_on_validation(
            bnn, val_loader, set_knob=lambda v: bnn.state.set(name, v), grid=list(grid),
            rule="one_se", prefer="largest", batch_fn=batch_fn, name=name,
        )
    finally:
        bnn.train(was_training)
    logger.info("%s: %s = %.3g chosen on validation NLL (%s)", bnn.method_name, name,
                record[name], meaning)
    return record


class ScaledLogits(nn.Module):
    """``x → members(x) / T``: the member temperature frozen into an exported module."""

    def __init__(self, members: nn.Module, temperature: float) -> None:
        super().__init__()
        self.members = members
        self.register_buffer("member_temperature", torch.tensor(float(temperature)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.members(x) / self.member_temperature.to(torch.float32)


class MemberTemperature:
    """Mixin of families whose members are deterministic networks (batchensemble,
    ensemble): their knob is a temperature ``T`` of every member's logits, applied in
    ``predictive`` (so the predictor, calibration, evaluation and the validation
    search see it; ``member_logits`` stays the raw members, which the default export
    freezes) and in ``export_module``. Set ``knob_name``; call :func:`add_knob` in
    ``prepare``."""

    knob_name: str = "member_temperature"

    def predictive(self, bnn: BayesianModel, x: Any, **kwargs: Any) -> Any:
        from bayesify.core.prediction import Prediction

        logits = self.member_logits(bnn, x, **kwargs).float()  # type: ignore[attr-defined]
        temperature = bnn.state.get_buffer(self.knob_name)
        return Prediction(logits / temperature.to(logits.device, torch.float32))

    def export_module(self, bnn: BayesianModel, **kwargs: Any) -> nn.Module:
        members = super().export_module(bnn, **kwargs)  # type: ignore[misc]
        return with_member_temperature(members, bnn.state.value(self.knob_name))


def with_member_temperature(members: nn.Module, temperature: float) -> nn.Module:
    """``members`` itself at T = 1 (the untuned export is unchanged), else :class:`ScaledLogits`."""
    return members if temperature == 1.0 else ScaledLogits(members, temperature)


class SpreadKnob:
    """Mixin (before ``Method`` in the bases) for families whose knob multiplies the learned
    posterior spread: registered in ``prepare``, reset to 1 by ``begin_fit``, tuned on
    ``val_loader`` in ``finish_fit``. Set ``knob`` (the state name) and ``knob_meaning``."""

    knob: str = ""
    knob_meaning: str = ""

    def prepare(self, bnn: BayesianModel) -> None:
        add_knob(bnn, self.knob, layers=bnn.bayesian_layers().values())

    def begin_fit(self, bnn: BayesianModel, *, steps_per_epoch: int, epochs: int) -> None:
        reset_knob(bnn, self.knob)

    def finish_fit(self, bnn: BayesianModel, *, train_loader: Any, val_loader: Any, ctx: Any,
                   batch_fn: Any = None) -> dict[str, Any]:
        """With ``val_loader``: the spread multiplier by validation NLL (shared one-SE search)."""
        return tune_knob(bnn, val_loader, name=self.knob, grid=SPREAD_GRID, batch_fn=batch_fn,
                         meaning=self.knob_meaning)
