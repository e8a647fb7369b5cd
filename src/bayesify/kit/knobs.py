"""The predictive-scale knob of a gradient-trained family, held in ``bnn.state``.

Each family declares one knob with a plain meaning (a :class:`~bayesify.core.fitting.Knob`)
and registers its state entry in ``prepare`` (:func:`add_knob`): a multiplier of the
learned posterior std / noise (ibnn, rank1, meanfield, hypernet; 0 is the mean network),
a multiplier of the dropout rate (dropout; 0 is the deterministic network) or a
temperature of the members' logits (batchensemble, ensemble; bounded grid, never
T → 0). The knob is 1 while training (layers read it only in eval mode,
:func:`knob_value`); ``fit`` installs its ``initial`` value 1 before the first step and,
given a ``val_loader``, the driver's knob search chooses it. Being a buffer of
``bnn.state`` it is saved, loaded and checkpointed with the posterior, so a reloaded
posterior predicts exactly as the tuned one; layers read it inside their forward, so
export (which runs the layers with frozen noise) applies it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.fitting import Knob
from bayesify.core.prediction import Prediction

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

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


def times_knob(values: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``values`` × :func:`knob_value` — ``values`` itself (no kernel, same numbers) when the
    knob is the training-mode 1: the multiply launched a kernel per layer and step, forward
    and backward, for nothing (a weight-sized one for mean-field and MNF)."""
    value = knob_value(layer)
    if isinstance(value, float) and value == 1.0:
        return values
    return values * value


def knob_float(layer: nn.Module) -> float:
    """:func:`knob_value` as a Python float (for layers that branch on it)."""
    value = knob_value(layer)
    return float(value) if isinstance(value, torch.Tensor) else value


def state_knob(bnn: BayesianModel, name: str, *, grid: Iterable[float], meaning: str,
               prefer: str = "largest", initial: float | None = 1.0,
               walk: bool = True, one_sample_at: float | None = None) -> Knob:
    """The :class:`Knob` of the ``bnn.state`` entry ``name`` (1 = the trained posterior)."""
    return Knob(name=name, grid=tuple(float(v) for v in grid), meaning=meaning,
                set=lambda value: bnn.state.set(name, value), prefer=prefer, initial=initial,
                walk=walk, one_sample_at=one_sample_at)


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
    freezes) and in ``export_module``."""

    knob_name: str = "member_temperature"

    def prepare(self, bnn: BayesianModel) -> None:
        add_knob(bnn, self.knob_name)

    def knobs(self, bnn: BayesianModel) -> list[Knob]:
        return [state_knob(bnn, self.knob_name, grid=TEMPERATURE_GRID,
                           meaning="temperature of every member's logits")]

    def predictive(self, bnn: BayesianModel, x: Any, **kwargs: Any) -> Any:
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
    """Mixin (before the method base) for families whose knob multiplies the learned
    posterior spread: registered in ``prepare`` for every injected layer, declared by
    ``knobs``. Set ``knob`` (the state name), ``knob_meaning`` and, to narrow it,
    ``knob_grid``; ``knob_walk`` False to score every value of the grid
    (:attr:`~bayesify.core.fitting.Knob.walk`). The knob multiplies every random term of
    the posterior, so at 0 every sample of a component is its mean network: the search
    scores 0 with one sample per component (:attr:`~bayesify.core.fitting.Knob.one_sample_at`;
    tested per family in ``tests/test_shift.py``)."""

    knob: str = ""
    knob_meaning: str = ""
    knob_grid: tuple[float, ...] = SPREAD_GRID
    knob_walk: bool = True

    def prepare(self, bnn: BayesianModel) -> None:
        add_knob(bnn, self.knob, layers=bnn.bayesian_layers().values())

    def knobs(self, bnn: BayesianModel) -> list[Knob]:
        return [state_knob(bnn, self.knob, grid=self.knob_grid, meaning=self.knob_meaning,
                           walk=self.knob_walk, one_sample_at=0.0)]
