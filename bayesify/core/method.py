"""The protocol every posterior family implements.

A family is a :class:`Method` subclass plus a config dataclass and its layers,
in one folder that imports only ``bayesify.core``. A family is made of a few
explicit parts:

* **structure**: the type → wrapper table (``wrappers``), ``validate_plan`` (checks
  on the planned targets, before anything is built) and ``extra_wrappers`` (modules
  besides the targets, e.g. per-member BatchNorm) — all built before the factory's
  first ``setattr``;
* **batch layout**: ``train_components`` / ``training_forward`` (how a training
  batch is tiled over components) and ``member_logits`` (the predictive members);
* **training** (``training`` selects the step of the one loop in
  ``bayesify.train``): ``"elbo"`` — gradient steps on NLL + β·KL/N with ``kl`` and
  an optional ``kl_weight``; ``"snapshot"`` — SGD steps whose iterates the family
  collects in ``after_step`` (SWAG, snapshot ensembles); ``"curvature"`` — one
  gradient-free pass feeding ``accumulate`` (Laplace). Every kind may finish with
  ``finish_fit`` (e.g. BatchNorm statistics, a validation-tuned scale);
* **state**: posterior parameters and buffers of the injected layers plus
  family-level buffers in ``bnn.state``; persistence saves them generically.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from bayesify.core.batch import batch_device, batch_rows, call_model, tile
from bayesify.core.config import MethodConfig
from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer
from bayesify.core.outputs import logits_of
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
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


class Method:
    """Base class of a posterior family. Subclasses set the class attributes."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[MethodConfig]] = MethodConfig
    #: explicit type → wrapper table; isinstance match in this order
    wrappers: ClassVar[dict[type[nn.Module], type[BayesianLayer]]] = {}
    #: the step of the one training loop: "elbo", "snapshot" or "curvature"
    training: ClassVar[str] = "elbo"
    #: fit options the family cannot honour (an error when given)
    unsupported_fit_options: ClassVar[tuple[str, ...]] = ()
    #: whether ``deterministic()`` reproduces the base network at identity init
    has_identity: ClassVar[bool] = True

    def __init__(self, config: MethodConfig) -> None:
        self.config = config

    # -- structure ---------------------------------------------------------------
    @property
    def components(self) -> int:
        """Number of posterior components / members K (1 for unimodal families)."""
        return int(getattr(self.config, "components", 1))

    def supports(self, module: nn.Module) -> bool:
        return any(isinstance(module, t) for t in self.wrappers)

    def wrap(self, name: str, module: nn.Module, context: SamplingContext) -> BayesianLayer:
        """Build the injected layer for ``module`` (not yet installed)."""
        for layer_type, wrapper in self.wrappers.items():
            if isinstance(module, layer_type):
                return wrapper(module, context=context, config=self.config)
        raise TypeError(f"{self.name} cannot wrap {type(module).__name__}")

    @property
    def gradient_trained(self) -> bool:
        """Whether ``fit`` takes gradient steps (every kind but "curvature")."""
        return self.training != "curvature"

    def validate_plan(self, model: nn.Module, targets: list[str]) -> None:
        """Refuse a plan this family cannot use (called before anything is built)."""

    def extra_wrappers(self, model: nn.Module, context: SamplingContext,
                       targets: list[str]) -> dict[str, BayesianLayer]:
        """Modules to install besides the target wrappers, by qualified name (built
        from ``model`` but not installed: the factory installs everything at once)."""
        return {}

    def prepare(self, bnn: BayesianModel) -> None:
        """Hook run once after injection: register family state in ``bnn.state``.
        Must not change the module structure (that is ``extra_wrappers``)."""

    # -- post-hoc parts of the one loop -----------------------------------------------
    def unsupported_reason(self) -> str:
        """Why ``unsupported_fit_options`` do not apply (part of the error message)."""
        return "they do not apply to this family"

    def fit_defaults(self) -> dict[str, Any]:
        """``fit`` options this family sets when the caller leaves them at None: ``lr``,
        ``momentum``, ``weight_decay``, ``lr_schedule``, ``optimizer``, ``clip_grad_norm``."""
        return {}

    def begin_fit(self, bnn: BayesianModel, *, steps_per_epoch: int, epochs: int) -> None:
        """Called once before the first step (not again on resume)."""

    def before_step(self, bnn: BayesianModel, state: Any) -> None:
        """Called before every optimiser step (snapshot: cyclic LR, member switch)."""

    def after_step(self, bnn: BayesianModel, state: Any) -> None:
        """Called after every optimiser step (snapshot: collect the iterate)."""

    def accumulate(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """Curvature step: add one batch's curvature; returns the summed loss ``[]``."""
        raise NotImplementedError(f"{self.name} has no curvature step")

    def finish_fit(self, bnn: BayesianModel, *, train_loader: Any, val_loader: Any,
                   ctx: Any, batch_fn: Any = None) -> dict[str, Any]:
        """Called once after the last step: reduce, finalise and tune; returns a record.
        ``train_loader`` is this rank's shard of the training data (every example once
        over all ranks)."""
        return {}

    def extra_posterior_parameters(self, bnn: BayesianModel) -> Iterator[tuple[str, nn.Parameter]]:
        """Posterior tensors living outside the injected layers (e.g. shared generators)."""
        return iter(())

    # -- training ------------------------------------------------------------------
    def train_components(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """``[R]`` component of every row of the tiled training batch (R = reps·B).

        Default (iBNN, Algorithm 1): each example repeated ``samples`` times,
        rows dealt to components round-robin, ``row % K``.
        """
        reps = int(getattr(self.config, "samples", 1))
        rows = reps * batch_size
        return torch.arange(rows, device=device) % self.components

    def training_forward(
        self, bnn: BayesianModel, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[R, C]`` and targets ``[R]`` of one tiled training batch."""
        rows, device = batch_rows(x), batch_device(x)
        comp = self.train_components(rows, device)
        reps = comp.shape[0] // rows
        xt, yt = tile(x, reps), tile(y, reps)
        with bnn.context.use(comp):
            logits = logits_of(call_model(bnn.model, xt))
        return logits, yt

    def kl(self, bnn: BayesianModel) -> torch.Tensor:
        """KL(q‖p) summed over every injected layer (not divided by N_train)."""
        total = torch.zeros((), device=bnn.device)
        for layer in bnn.bayesian_layers().values():
            total = total + layer.kl().to(total.device, torch.float32)
        return total

    # -- prediction ------------------------------------------------------------------
    def member_components(self, samples_per_component: int, device: torch.device) -> torch.Tensor:
        """``[M]`` component of every predictive member (K components × n samples)."""
        k = self.components
        return torch.arange(k * samples_per_component, device=device) // samples_per_component

    def member_logits(
        self,
        bnn: BayesianModel,
        x: torch.Tensor,
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
        members = self.member_components(samples_per_component, device)
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
                   max_rows: int, seed: int | None = None, deterministic: bool = False) -> Any:
        """The raw (temperature 1) :class:`~bayesify.core.prediction.Prediction` of
        ``x``: member logits by default; a family with a closed-form predictive
        returns a Gaussian over the logits instead."""
        from bayesify.core.prediction import Prediction

        return Prediction(self.member_logits(
            bnn, x, samples_per_component=samples_per_component, max_rows=max_rows, seed=seed,
            deterministic=deterministic).float())

    # -- export ------------------------------------------------------------------------
    def export_module(
        self,
        bnn: BayesianModel,
        *,
        samples_per_component: int,
        seed: int,
        example_input: torch.Tensor,
    ) -> nn.Module:
        """A plain module ``x [B, ...] → member logits [M, B, C]`` with frozen samples
        (seeded exactly as at prediction); see :mod:`bayesify.kit.frozen_noise` for the
        one most noise families use. A family that cannot be exported raises a
        ``BayesifyError`` saying why."""
        raise BayesifyError(f"method {self.name!r} cannot be exported: the family does not "
                            "implement Method.export_module")

    def default_lr(self) -> float:
        """Learning rate of the posterior group when ``fit(lr=None)``."""
        return 0.1

    def param_groups(self, bnn: BayesianModel, *, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """Optimiser groups of the posterior (the base group is added by the trainer).

        Default: one group ``"posterior"`` at ``lr``. Families with a per-group LR
        multiplier (BatchEnsemble fast weights) return several groups.
        """
        posterior = [p for p in bnn.posterior_parameters() if p.requires_grad]
        return [{"params": posterior, "lr": lr, "weight_decay": weight_decay, "name": "posterior"}]

    def default_samples_per_component(self) -> int:
        return int(getattr(self.config, "predict_samples", 1))


