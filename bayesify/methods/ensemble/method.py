"""ensemble family: deep ensembles (Lakshminarayanan et al. 2017) and snapshot ensembles.

Design (one tiled module rather than M model objects): every target layer holds M
weight copies and rows are routed by member, so the M members train together in one
batch-tiled forward (mathematically M independent fine-tunings on the same batch
sequence: their parameters are disjoint) and predict through the shared
``EnsemblePredictor`` with member outputs stacked ``[M, B, C]``.

What is per member: every wrapped Conv/Linear (``targets='all'``, the default; use
``targets='last_layer'`` for head-only ensembles) and, with ``per_member_bn=True``,
every BatchNorm (statistics and γ, β). What is shared: parameters of modules that
are not wrapped (LayerNorm, embeddings, position embeddings, ...); they stay frozen
unless ``fit(base_lr > 0)``, in which case they are fine-tuned jointly — members are
then no longer fully independent. Diversity comes from a per-member random head
(``head_init='random'``, seeded ``seed + k``) and optional weight jitter.

Snapshot ensembles (``snapshot=True``, Huang et al. 2017): one SGD run with a cyclic
cosine learning rate over M cycles; the weights reached at the end of cycle k are
member k (the next cycle continues from them in the next slot).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from bayesify.core.batch import batch_device, batch_rows, call_model
from bayesify.core.outputs import logits_of
from bayesify.core.walker import find_classifier
from bayesify.errors import BayesifyError
from bayesify.kit.knobs import (
    TEMPERATURE_GRID,
    MemberTemperature,
    add_knob,
    reset_knob,
    tune_knob,
    with_member_temperature,
)
from bayesify.kit.member_bn import MemberBatchNorm
from bayesify.kit.tiled import TiledMethod
from bayesify.methods.ensemble.config import EnsembleConfig
from bayesify.methods.ensemble.export import export_ensemble
from bayesify.methods.ensemble.layers import EnsembleLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger("bayesify")


class EnsembleMethod(MemberTemperature, TiledMethod):
    """M weight copies per target layer, trained tiled (or as snapshots), stacked at prediction.

    Knob: ``member_temperature``, a temperature of every member's logits chosen on
    validation data (bounded grid) when ``fit`` gets a ``val_loader``.
    """

    name = "ensemble"
    config_cls = EnsembleConfig
    wrappers: ClassVar = {
        nn.Linear: EnsembleLayer,
        nn.Conv1d: EnsembleLayer,
        nn.Conv2d: EnsembleLayer,
        nn.Conv3d: EnsembleLayer,
    }

    def __init__(self, config: EnsembleConfig) -> None:
        super().__init__(config)
        # snapshot ensembles: SGD steps with a cyclic LR, one member per cycle
        self.training = "snapshot" if config.snapshot else "elbo"  # type: ignore[misc]
        self._state: Any = None

    @property
    def active_member(self) -> int:
        return int(self._state.value("snapshot_member")) if self._state is not None else 0

    def prepare(self, bnn: BayesianModel) -> None:
        super().prepare(bnn)
        bnn.state.add("snapshot_member", torch.zeros((), dtype=torch.long))
        bnn.state.add("snapshot_cycle", torch.zeros((), dtype=torch.float64))
        add_knob(bnn, self.knob_name)
        self._state = bnn.state
        if self.config.head_init == "pretrained" and self.config.init_noise == 0 and \
                not self.config.snapshot:
            logger.warning(
                "ensemble: head_init='pretrained' with init_noise=0 starts %d identical members "
                "that see identical batches: they stay identical (no spread). Set init_noise > 0 "
                "or head_init='random'", self.components)
        if self.config.head_init == "random" and not self.config.snapshot:
            head = find_classifier(bnn.model)
            layers = bnn.bayesian_layers()
            name = head.removesuffix(".base_layer") if head else None
            layer = layers.get(name) if name else None
            if isinstance(layer, EnsembleLayer):
                for k in range(self.components):
                    layer.reset_member(k, torch.Generator().manual_seed(self.config.seed + k))

    def default_samples_per_component(self) -> int:
        return 1  # members are deterministic networks

    def default_lr(self) -> float:
        # the members are copies of the pretrained weights: a fine-tuning step (1e-3; 1e-2
        # diverged on a pretrained BN CNN), scaled by M because the mean loss over M
        # tiled copies gives each member 1/M of its gradient
        return 0.001 * self.components

    def export_module(self, bnn: BayesianModel, *, samples_per_component: int, seed: int,
                      example_input: torch.Tensor) -> nn.Module:
        """``x → [M, B, C]`` from one plain network per member (the in-process routing,
        ``bincount().tolist()``, is data-dependent); see :mod:`bayesify.methods.ensemble.export`."""
        members = export_ensemble(bnn, samples_per_component=samples_per_component,
                                  example_input=example_input)
        return with_member_temperature(members, bnn.state.value(self.knob_name))

    # -- snapshot ensembles --------------------------------------------------------------
    def training_forward(
        self, bnn: BayesianModel, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.config.snapshot:
            return super().training_forward(bnn, x, y)
        comp = torch.full((batch_rows(x),), self.active_member, dtype=torch.long,
                          device=batch_device(x))
        with bnn.context.use(comp):
            return logits_of(call_model(bnn.model, x)), y

    def _copy_member(self, bnn: BayesianModel, source: int, target: int) -> None:
        with torch.no_grad():
            for layer in bnn.bayesian_layers().values():
                if isinstance(layer, EnsembleLayer):
                    layer.copy_member(source, target)
                elif isinstance(layer, MemberBatchNorm):
                    for t in (layer.member_weight, layer.member_bias, layer.member_running_mean,
                              layer.member_running_var):
                        t[target].copy_(t[source])

    # -- snapshot ensembles in the one loop (training = "snapshot") -------------------
    def fit_defaults(self) -> dict[str, Any]:
        return {"lr": 0.01} if self.config.snapshot else {}

    def begin_fit(self, bnn: BayesianModel, *, steps_per_epoch: int, epochs: int) -> None:
        """Snapshot ensemble: a cosine LR restarted every ``epochs·steps / M`` steps."""
        reset_knob(bnn, self.knob_name)
        if self.config.head_init == "random" and not self.config.snapshot and epochs < 5:
            logger.warning(
                "ensemble: head_init='random' re-initialised every member's classifier; %d "
                "epoch(s) may not retrain them to the base network's accuracy (use more epochs "
                "or head_init='pretrained')", epochs)
        if not self.config.snapshot:
            return
        cycle = epochs * steps_per_epoch / self.components
        if cycle < 1:
            raise BayesifyError(
                f"snapshot ensemble needs at least one step per member: {epochs} epoch(s) × "
                f"{steps_per_epoch} step(s) < components={self.components}; train longer"
            )
        bnn.state.set("snapshot_cycle", cycle)
        bnn.state.set("snapshot_member", 0)

    def before_step(self, bnn: BayesianModel, state: Any) -> None:
        """Member k's slot is trained during cycle k, starting from the end of cycle k−1;
        the optimiser state is reset at every restart."""
        if not self.config.snapshot:
            return
        cycle = bnn.state.value("snapshot_cycle")
        step = state.global_step
        member = min(int(step // cycle), self.components - 1)
        if member != self.active_member:
            self._copy_member(bnn, self.active_member, member)
            bnn.state.set("snapshot_member", member)
            state.optimizer.state.clear()  # old slots get zero gradients; no stale momentum
        phase = (step - member * cycle) / cycle
        for group, base in zip(state.optimizer.param_groups, state.base_lrs):
            group["lr"] = 0.5 * base * (1 + math.cos(math.pi * min(phase, 1.0)))

    def finish_fit(self, bnn: BayesianModel, *, train_loader: Any = None, val_loader: Any = None,
                   ctx: Any = None, batch_fn: Any = None) -> dict[str, Any]:
        """Snapshot ensembles: back to member 0. With ``val_loader``: the members' logit
        temperature by validation NLL (shared one-SE search, bounded grid)."""
        record: dict[str, Any] = {}
        if self.config.snapshot:
            bnn.state.set("snapshot_member", 0)
            record["snapshots"] = self.components
        record.update(tune_knob(bnn, val_loader, name=self.knob_name, grid=TEMPERATURE_GRID,
                                batch_fn=batch_fn, meaning="temperature of every member's logits"))
        return record
