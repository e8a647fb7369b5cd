"""The protocol every posterior family implements.

A family is a :class:`Method` subclass plus a config dataclass and its layers.
Gradient-trained families expose ``kl``; post-hoc families (SWAG, Laplace)
override :meth:`Method.fit`. Everything has a sensible default so a family only
overrides what differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from bayesify.core.config import MethodConfig
from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer

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


def logits_of(output: Any) -> torch.Tensor:
    """Class logits from a model output (tensor, HF ``ModelOutput`` or tuple)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}")


class Method:
    """Base class of a posterior family. Subclasses set the class attributes."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[MethodConfig]] = MethodConfig
    #: explicit type → wrapper table; isinstance match in this order
    wrappers: ClassVar[dict[type[nn.Module], type[BayesianLayer]]] = {}
    #: families trained by the ELBO loop; post-hoc families set False
    gradient_trained: ClassVar[bool] = True
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

    def prepare(self, bnn: BayesianModel) -> None:
        """Hook run once after injection (e.g. per-member BatchNorm)."""

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
        comp = self.train_components(x.shape[0], x.device)
        reps = comp.shape[0] // x.shape[0]
        xt, yt = tile(x, reps), tile(y, reps)
        with bnn.context.use(comp):
            logits = logits_of(bnn.model(xt))
        return logits, yt

    def kl(self, bnn: BayesianModel) -> torch.Tensor:
        """KL(q‖p) summed over every injected layer (not divided by N_train)."""
        total = torch.zeros((), device=bnn.device)
        for layer in bnn.bayesian_layers().values():
            total = total + layer.kl().to(total.device, torch.float32)
        return total

    def fit(self, bnn: BayesianModel, loader: Any, **kwargs: Any) -> dict[str, Any] | None:
        """Post-hoc fitting (SWAG, Laplace). Gradient families return ``None``."""
        return None

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
        members = self.member_components(samples_per_component, x.device)
        num_members, batch = members.shape[0], x.shape[0]
        per_chunk = max(1, max_rows // max(batch, 1))
        outs = []
        for start in range(0, num_members, per_chunk):
            ids = torch.arange(start, min(start + per_chunk, num_members), device=x.device)
            with bnn.context.use(
                members[ids].repeat_interleave(batch),
                deterministic=deterministic,
                member=ids.repeat_interleave(batch),
                num_members=num_members,
                seed=seed,
            ):
                logits = logits_of(bnn.model(tile(x, ids.shape[0])))
            outs.append(logits.reshape(ids.shape[0], batch, -1))
        return torch.cat(outs, dim=0)

    # -- persistence and export ------------------------------------------------------
    def posterior_state(self, bnn: BayesianModel) -> dict[str, torch.Tensor]:
        """Non-parameter tensors the posterior needs (e.g. SWAG moments as buffers).

        Keys are base-model module names (``"layer1.0.conv1.sq_mean"``); they are
        saved next to ``named_posterior_parameters`` by ``save_posterior``.
        """
        return {}

    def load_posterior_state(self, bnn: BayesianModel, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`posterior_state` returned (keys already checked)."""
        if state:
            from bayesify.errors import BayesifyError

            raise BayesifyError(
                f"method {self.name!r} keeps no posterior state, but the file holds "
                f"{sorted(state)[:5]}; it was written by a different family or version"
            )

    def export_module(
        self,
        bnn: BayesianModel,
        *,
        samples_per_component: int,
        seed: int,
        example_input: torch.Tensor,
    ) -> nn.Module:
        """A plain module ``x [B, ...] → member logits [M, B, C]`` with frozen samples.

        Default: a copy of the network whose layers read their per-member noise
        from tables recorded once from ``SamplingContext.draw`` (seeded exactly as
        at prediction). Families whose prediction is not "M networks that draw
        noise through the context" override this or raise a ``BayesifyError``.
        """
        from bayesify.predict.export import frozen_noise_members

        return frozen_noise_members(
            bnn, samples_per_component=samples_per_component, seed=seed,
            example_input=example_input,
        )

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

    @classmethod
    def demo_recipe(cls) -> dict[str, Any]:
        """Options for the digits demo: ``{"options": {...}, "fit": {...}, "predictor": {...}}``."""
        return {"options": {}, "fit": {"epochs": 10}}

    def default_samples_per_component(self) -> int:
        return int(getattr(self.config, "predict_samples", 1))


def tile(x: torch.Tensor, reps: int) -> torch.Tensor:
    """``[B, ...]`` → ``[reps·B, ...]`` in blocks: row ``r`` is example ``r % B``."""
    if reps == 1:
        return x
    return x.repeat(reps, *([1] * (x.dim() - 1)))
