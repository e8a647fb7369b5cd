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
import torch.nn.functional as F
from torch import nn

from bayesify.core.batch import batch_device, batch_rows, call_model
from bayesify.core.context import SamplingContext
from bayesify.core.fitting import FitContext, Step
from bayesify.core.names import base_name
from bayesify.core.outputs import logits_of
from bayesify.core.walker import find_classifier
from bayesify.errors import BayesifyError
from bayesify.kit.knobs import MemberTemperature, with_member_temperature
from bayesify.kit.member_bn import MemberBatchNorm
from bayesify.kit.steps import ElboStep, Layout, SnapshotStep, Tiled
from bayesify.kit.tiled import TiledMethod
from bayesify.methods.ensemble.config import EnsembleConfig
from bayesify.methods.ensemble.export import export_ensemble
from bayesify.methods.ensemble.layers import EnsembleLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)


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

    def build(self, model: nn.Module, targets: list[str],
              context: SamplingContext) -> dict[str, nn.Module]:
        """The member copies; with ``per_network`` (the default) and L > 1 wrapped layers
        every layer's jitter is ``init_noise / √L``, so the members start within ~init_noise
        of the pretrained function whatever the depth (as iBNN's ``per_network``)."""
        layers = super().build(model, targets, context)
        members = [m for m in layers.values() if isinstance(m, EnsembleLayer)]
        if self.config.per_network and len(members) > 1 and self.config.init_noise > 0:
            shrink = 1.0 / math.sqrt(len(members))
            with torch.no_grad():
                for layer in members:
                    base = layer.base_layer.weight.detach().unsqueeze(0)
                    layer.member_weight.sub_(base).mul_(shrink).add_(base)
        return layers

    def prepare(self, bnn: BayesianModel) -> None:
        bnn.state.add("snapshot_member", torch.zeros((), dtype=torch.long))
        bnn.state.add("snapshot_cycle", torch.zeros((), dtype=torch.float64))
        super().prepare(bnn)  # the member temperature
        cfg: EnsembleConfig = self.config
        if cfg.head_init == "pretrained" and cfg.init_noise == 0 and not cfg.snapshot:
            logger.warning(
                "ensemble: head_init='pretrained' with init_noise=0 starts %d identical members "
                "that see identical batches: they stay identical (no spread). Set init_noise > 0 "
                "or head_init='random'", self.components)
        if cfg.head_init == "random" and not cfg.snapshot:
            head = find_classifier(bnn.model)
            layer = bnn.bayesian_layers().get(base_name(head)) if head else None
            if isinstance(layer, EnsembleLayer):
                for k in range(self.components):
                    layer.reset_member(k, torch.Generator().manual_seed(cfg.seed + k))

    def step(self) -> Step:
        if self.config.snapshot:  # SGD steps of the one loop, one member per cycle
            return SnapshotEnsembleStep(self.components)
        # lr: the members are copies of the pretrained weights: a fine-tuning step (1e-3;
        # 1e-2 diverged on a pretrained BN CNN), scaled by M because the mean loss over M
        # tiled copies gives each member 1/M of its gradient. clip_grad_norm 1: the
        # gradient of whole weights grows with the logit scale and 1/σ of frozen BatchNorm
        # statistics; unclipped, a BN CNN with 20× logits diverged in two steps and ended at
        # chance accuracy (issue 30). lr_schedule cosine: without a validation split the
        # last iterate is the ensemble; at a constant rate with batches of one it was a
        # random walk's last sample (0.60 accuracy vs a 0.69 start; annealed: 0.83)
        return EnsembleStep(Tiled(self.components), lr=0.001 * self.components,
                            defaults={"clip_grad_norm": 1.0, "lr_schedule": "cosine"})

    def export_module(self, bnn: BayesianModel, *, samples_per_component: int, seed: int,
                      example_input: torch.Tensor) -> nn.Module:
        """``x → [M, B, C]`` from one plain network per member (the in-process routing,
        ``bincount().tolist()``, is data-dependent); see :mod:`bayesify.methods.ensemble.export`."""
        members = export_ensemble(bnn, samples_per_component=samples_per_component,
                                  example_input=example_input)
        return with_member_temperature(members, bnn.state.value(self.knob_name))


class EnsembleStep(ElboStep):
    """Deep ensemble: the ELBO step of the tiled members (no KL: the layers have none).

    With ``bootstrap=True`` the NLL of member k is ``Σ_b w_kb ℓ_kb / Σ_b w_kb`` with
    ``w_kb ~ Poisson(1)`` per row (online bagging), averaged over the members."""

    def terms(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not bnn.posterior_config.bootstrap:
            return super().terms(bnn, inputs, labels, generator)
        with bnn.context.use(None, generator=generator):
            logits, targets = self.forward(bnn, inputs, labels)
        members = int(bnn.posterior_config.components)
        rows = F.cross_entropy(logits.float(), targets, reduction="none").view(members, -1)
        rates = torch.ones(rows.shape, device=rows.device)
        draw = (generator if generator is not None and generator.device == rows.device
                else None)
        weights = torch.poisson(rates, generator=draw)
        nll = ((weights * rows).sum(1) / weights.sum(1).clamp_min(1.0)).mean()
        return nll, torch.zeros((), device=nll.device)

    def begin(self, ctx: FitContext) -> None:
        cfg: EnsembleConfig = ctx.bnn.posterior_config
        if cfg.head_init == "random" and ctx.epochs < 5:
            logger.warning(
                "ensemble: head_init='random' re-initialised every member's classifier; %d "
                "epoch(s) may not retrain them to the base network's accuracy (use more epochs "
                "or head_init='pretrained')", ctx.epochs)


class ActiveMember(Layout):
    """Snapshot ensembles: every row trains the member of the current cycle."""

    def __call__(self, bnn: BayesianModel, x: Any,
                 y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        member = int(bnn.state.value("snapshot_member"))
        comp = torch.full((batch_rows(x),), member, dtype=torch.long, device=batch_device(x))
        with bnn.context.use(comp):
            return logits_of(call_model(bnn.model, x)), y


class SnapshotEnsembleStep(SnapshotStep):
    """Snapshot ensemble (Huang et al. 2017): a cosine LR restarted every
    ``epochs·steps / M`` optimiser steps; member k's slot trains during cycle k, starting
    from the end of cycle k−1."""

    def __init__(self, components: int) -> None:
        super().__init__(ActiveMember(), defaults={"lr": 0.01})
        self.components = components

    def ready(self, bnn: BayesianModel) -> bool:
        """The snapshots exist once ``fit`` has taken them (the cycle length is set then)."""
        return float(bnn.state.value("snapshot_cycle")) > 0

    def begin(self, ctx: FitContext) -> None:
        cycle = ctx.epochs * ctx.steps_per_epoch / self.components
        if cycle < 1:
            raise BayesifyError(
                f"snapshot ensemble needs at least one step per member: {ctx.epochs} epoch(s) × "
                f"{ctx.steps_per_epoch} step(s) < components={self.components}; train longer"
            )
        ctx.bnn.state.set("snapshot_cycle", cycle)
        ctx.bnn.state.set("snapshot_member", 0)

    def before_update(self, ctx: FitContext) -> None:
        """Switch to the cycle's member (copying the previous one into its slot; the
        optimiser state is reset at every restart) and set the cosine LR."""
        state = ctx.bnn.state
        cycle = state.value("snapshot_cycle")
        step = ctx.global_step
        member = min(int(step // cycle), self.components - 1)
        active = int(state.value("snapshot_member"))
        if member != active:
            copy_member(ctx.bnn, active, member)
            state.set("snapshot_member", member)
            ctx.optimizer.state.clear()  # old slots get zero gradients; no stale momentum
        phase = (step - member * cycle) / cycle
        for group, base in zip(ctx.optimizer.param_groups, ctx.base_lrs):
            group["lr"] = 0.5 * base * (1 + math.cos(math.pi * min(phase, 1.0)))

    def end(self, ctx: FitContext) -> dict[str, Any]:
        """Back to member 0."""
        ctx.bnn.state.set("snapshot_member", 0)
        return {"snapshots": self.components}


def copy_member(bnn: BayesianModel, source: int, target: int) -> None:
    """Member ``source``'s weights (and per-member BatchNorm) into slot ``target``."""
    with torch.no_grad():
        for layer in bnn.bayesian_layers().values():
            if isinstance(layer, EnsembleLayer):
                layer.copy_member(source, target)
            elif isinstance(layer, MemberBatchNorm):
                for t in (layer.member_weight, layer.member_bias, layer.member_running_mean,
                          layer.member_running_var):
                    t[target].copy_(t[source])
