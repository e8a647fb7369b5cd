"""The few explicit protocols a posterior family implements.

:class:`~bayesify.core.method.Method` provides a default for every member, so a
family (one folder under ``bayesify/methods``, importing only ``bayesify.core``)
overrides only the parts that differ. Each protocol is one concern:

* :class:`Structure` — where the posterior goes (planned and built before the
  factory's first ``setattr``);
* :class:`BatchLayout` — how a batch is tiled over components in training and how
  the predictive members / moments are formed;
* :class:`Variational` — the ELBO's regulariser (``training = "elbo"``);
* :class:`PostHoc` — the hooks of the one loop for SGD-snapshot and curvature
  families (``training = "snapshot"`` / ``"curvature"``).

The registry tests (tests/test_registry_*.py) run every family through all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from bayesify.core.context import SamplingContext
    from bayesify.core.layers import BayesianLayer
    from bayesify.core.model import BayesianModel


@runtime_checkable
class Structure(Protocol):
    wrappers: ClassVar[dict[type[nn.Module], type[BayesianLayer]]]

    def validate_plan(self, model: nn.Module, targets: list[str]) -> None: ...

    def wrap(self, name: str, module: nn.Module, context: SamplingContext) -> BayesianLayer: ...

    def extra_wrappers(self, model: nn.Module, context: SamplingContext,
                       targets: list[str]) -> dict[str, BayesianLayer]: ...

    def prepare(self, bnn: BayesianModel) -> None: ...


@runtime_checkable
class BatchLayout(Protocol):
    def training_forward(self, bnn: BayesianModel, x: Any,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def member_logits(self, bnn: BayesianModel, x: Any, *, samples_per_component: int,
                      max_rows: int, seed: int | None = None,
                      deterministic: bool = False) -> torch.Tensor: ...

    def predictive(self, bnn: BayesianModel, x: Any, *, samples_per_component: int,
                   max_rows: int, seed: int | None = None, deterministic: bool = False) -> Any: ...


@runtime_checkable
class Variational(Protocol):
    def kl(self, bnn: BayesianModel) -> torch.Tensor: ...


@runtime_checkable
class PostHoc(Protocol):
    training: ClassVar[str]

    def begin_fit(self, bnn: BayesianModel, *, steps_per_epoch: int, epochs: int) -> None: ...

    def before_step(self, bnn: BayesianModel, state: Any) -> None: ...

    def after_step(self, bnn: BayesianModel, state: Any) -> None: ...

    def accumulate(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor) -> torch.Tensor: ...

    def finish_fit(self, bnn: BayesianModel, *, train_loader: Any, val_loader: Any, ctx: Any,
                   batch_fn: Any = None) -> dict[str, Any]: ...
