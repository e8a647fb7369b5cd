"""The base of every posterior family: structure, prediction, export — and its step.

A family is a config, layers and a step, in one folder (``bayesify/methods/<name>``)
that imports only ``bayesify.core``, ``bayesify.kit``, ``bayesify.errors`` and
``bayesify.metrics``. Its :class:`Method` subclass says

* **structure**: ``wrappers`` (the type → wrapper table) and :meth:`Method.build` (every
  module to install, validated and built before the factory's first ``setattr``);
  :meth:`Method.prepare` registers family state in ``bnn.state`` once wrapped;
* **training**: :meth:`Method.step` — the :class:`~bayesify.core.fitting.Step` the one
  epoch driver runs — and :meth:`Method.knobs`, the predictive-scale knobs it tunes;
* **prediction and export**: :meth:`Method.predictive`, :meth:`Method.member_logits`,
  :meth:`Method.export_module`.

A method object describes a family; it holds no model data. Per-model values live in
``bnn.state`` (saved), the layers' buffers (saved) or ``bnn.runtime`` (never saved).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from bayesify.core.batch import batch_device, batch_rows, call_model, tile
from bayesify.core.config import MethodConfig
from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer
from bayesify.core.outputs import logits_of
from bayesify.core.prediction import Prediction
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.fitting import Knob, Step
    from bayesify.core.model import BayesianModel

DEFAULT_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_TYPES: tuple[type[nn.Module], ...] = (
    nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
)


def wrapper_table(
    layer: type[BayesianLayer], *, transposed: bool = False
) -> dict[type[nn.Module], type[BayesianLayer]]:
    """The explicit type → wrapper table: Linear and Conv1d/2d/3d (+ ConvTranspose)."""
    types = DEFAULT_TYPES + (TRANSPOSED_TYPES if transposed else ())
    return dict.fromkeys(types, layer)


def wrapper_for(method: Method, module: nn.Module) -> type[BayesianLayer] | None:
    """The wrapper ``method`` uses for ``module`` (first isinstance match), or None."""
    for layer_type, wrapper in method.wrappers.items():
        if isinstance(module, layer_type):
            return wrapper
    return None


def wrap_targets(method: Method, model: nn.Module, targets: list[str],
                 context: SamplingContext, **extra: Any) -> dict[str, nn.Module]:
    """``{name: wrapper(module, context=..., config=..., **extra)}`` for every target."""
    modules = dict(model.named_modules())
    out: dict[str, nn.Module] = {}
    for name in targets:
        wrapper = wrapper_for(method, modules[name])
        if wrapper is None:
            raise TypeError(f"{method.name} cannot wrap {type(modules[name]).__name__}")
        out[name] = wrapper(modules[name], context=context, config=method.config, **extra)
    return out


def member_components(components: int, samples_per_component: int,
                      device: torch.device | None = None) -> torch.Tensor:
    """``[M]`` component of every predictive member: K components × n samples each."""
    return torch.arange(components * samples_per_component, device=device) // samples_per_component


class Method:
    """Base class of a posterior family (at most 12 members; see the module docstring)."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[MethodConfig]] = MethodConfig
    #: explicit type → wrapper table; isinstance match in this order
    wrappers: ClassVar[dict[type[nn.Module], type[BayesianLayer]]] = {}
    config: MethodConfig

    def __init__(self, config: MethodConfig) -> None:
        self.config = config

    @property
    def components(self) -> int:
        """Number of posterior components / members K (1 for unimodal families)."""
        return int(getattr(self.config, "components", 1))

    # -- structure ---------------------------------------------------------------------
    def build(self, model: nn.Module, targets: list[str],
              context: SamplingContext) -> dict[str, nn.Module]:
        """Every module to install, by qualified name: the target wrappers plus any extra
        module (e.g. per-member BatchNorm), built from ``model`` but not installed. Refuse
        a plan the family cannot use here (a ``BayesifyError``): the factory installs
        nothing before this returns, so a failed call leaves the caller's model untouched."""
        return wrap_targets(self, model, targets, context)

    def prepare(self, bnn: BayesianModel) -> None:
        """Once after injection: register family state in ``bnn.state`` (fixed shapes)."""

    # -- training ------------------------------------------------------------------------
    def step(self) -> Step:
        """A fresh :class:`~bayesify.core.fitting.Step` for one ``fit`` call."""
        raise BayesifyError(f"method {self.name!r} does not say how it is fitted: the family "
                            "has to implement Method.step")

    def knobs(self, bnn: BayesianModel) -> list[Knob]:
        """The predictive-scale knobs ``fit(val_loader=...)`` / ``bayesify.tune`` choose."""
        return []

    # -- prediction ----------------------------------------------------------------------
    def member_logits(
        self,
        bnn: BayesianModel,
        x: Any,
        *,
        samples_per_component: int,
        max_rows: int,
        seed: int | None = None,
        deterministic: bool = False,
    ) -> torch.Tensor:
        """``[M, B, C]`` logits of every member: tiled, chunked forward passes.

        Member ``m`` has component ``members[m]``; its noise is drawn once per
        member (seeded by ``seed``), so the M members are M fixed networks.
        """
        device = batch_device(x)
        members = member_components(self.components, samples_per_component, device)
        num_members, batch = members.shape[0], batch_rows(x)
        per_chunk = max(1, max_rows // max(batch, 1))
        outs = []
        for start in range(0, num_members, per_chunk):
            ids = torch.arange(start, min(start + per_chunk, num_members), device=device)
            with bnn.context.use(
                members[ids].repeat_interleave(batch),
                deterministic=deterministic,
                member=ids.repeat_interleave(batch),
                num_members=num_members,
                seed=seed,
            ):
                logits = logits_of(call_model(bnn.model, tile(x, ids.shape[0])))
            outs.append(logits.reshape(ids.shape[0], batch, -1))
        return torch.cat(outs, dim=0)

    def predictive(self, bnn: BayesianModel, x: Any, *, samples_per_component: int,
                   max_rows: int, seed: int | None = None, deterministic: bool = False) -> Prediction:
        """The raw (temperature 1) :class:`~bayesify.core.prediction.Prediction` of
        ``x``: member logits by default; a family with a closed-form predictive
        returns a Gaussian over the logits instead."""
        return Prediction(self.member_logits(
            bnn, x, samples_per_component=samples_per_component, max_rows=max_rows, seed=seed,
            deterministic=deterministic).float())

    # -- export --------------------------------------------------------------------------
    def export_module(
        self,
        bnn: BayesianModel,
        *,
        samples_per_component: int,
        seed: int,
        example_input: Any,
    ) -> nn.Module:
        """A plain module ``x [B, ...] → member logits [M, B, C]`` with frozen samples
        (seeded exactly as at prediction); see :mod:`bayesify.kit.frozen_noise` for the
        one most noise families use. A family that cannot be exported raises a
        ``BayesifyError`` saying why."""
        raise BayesifyError(f"method {self.name!r} cannot be exported: the family does not "
                            "implement Method.export_module")
