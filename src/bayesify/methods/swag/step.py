"""SWAG's snapshot step: SGD on each layer's working copy ``theta`` from the pretrained
weights, a snapshot into the layers' :class:`SWAGMoments` every ``period`` optimiser
steps; at the end θ ← θ̄ and the BatchNorm statistics of θ̄ and of the default
predictor's members are recomputed from the fit context's share of the training data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bayesify.core.fitting import FitContext
from bayesify.errors import BayesifyError
from bayesify.kit.steps import SnapshotStep
from bayesify.methods.swag import posterior as post
from bayesify.methods.swag import state
from bayesify.methods.swag.config import SWAGConfig
from bayesify.methods.swag.layers import SWAGBatchNorm, SWAGLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def tunes_scale(config: SWAGConfig) -> bool:
    """Whether the covariance scale is a knob chosen on validation data."""
    return config.variant != "swa" and config.scale_method in ("auto", "val_nll")


class SWAGStep(SnapshotStep):
    """SGD at the family's LR / momentum / weight decay (no KL, no other optimiser)."""

    def __init__(self, config: SWAGConfig) -> None:
        super().__init__(
            # clip_grad_norm 1: SGD's step on whole weights grows with the logit scale and
            # 1/σ of the frozen BatchNorm statistics; unclipped, a BN CNN with 20× logits
            # diverged at step 3 and SWAG averaged chance-level iterates (issue 30)
            defaults={"lr": config.lr, "momentum": config.momentum,
                      "weight_decay": config.weight_decay, "clip_grad_norm": 1.0},
            refused=("kl_anneal_epochs", "beta", "optimizer"),
            refusal="SWAG collects the iterates of plain SGD (no KL term, no other optimiser)",
        )
        self.config = config

    def ready(self, bnn: BayesianModel) -> bool:
        """The posterior exists once ``fit`` has built it."""
        return state.fitted(bnn)

    def start_state(self, bnn: BayesianModel) -> dict[str, torch.Tensor]:
        """The starting network as a SWAG posterior (see :func:`start_state`)."""
        return start_state(bnn)

    def begin(self, ctx: FitContext) -> None:
        """The snapshot period in optimiser steps; moments reset."""
        cfg, bnn = self.config, ctx.bnn
        if cfg.variant != "swa" and cfg.scale_method == "val_nll" and not ctx.validating:
            raise BayesifyError("scale_method='val_nll' needs fit(..., val_loader=...)")
        steps_per_epoch, epochs = ctx.steps_per_epoch, ctx.epochs
        total = epochs * steps_per_epoch
        if cfg.snapshot_every_steps:
            period = cfg.snapshot_every_steps
        elif cfg.snapshot_every is not None:
            period = max(1, round(cfg.snapshot_every * max(steps_per_epoch, 1)))
        else:  # max_rank snapshots spread over the run: the low-rank part is full at the end
            period = max(1, total // cfg.max_rank) if total else max(1, steps_per_epoch)
        if cfg.variant != "swa" and total and total // period < 2:
            raise BayesifyError(
                f"SWAG would collect {total // period} snapshot(s) in {epochs} epoch(s) × "
                f"{steps_per_epoch} step(s) with one every {period} step(s); a posterior needs "
                "at least 2 (its spread is zero otherwise). Raise epochs or lower "
                "snapshot_every / snapshot_every_steps"
            )
        bnn.state.set("swag_period", period)
        bnn.state.set("swag_fitted", 0)
        bnn.state.set("swag_bn_members", 0)
        state.forget_batchnorm(bnn)
        for layer in state.layers(bnn).values():
            layer.moments.reset()

    def before_update(self, ctx: FitContext) -> None:
        """The cyclic schedule: linear decay lr → lr_min within every snapshot period."""
        cfg = self.config
        if cfg.lr_schedule != "cyclic":
            return
        period = int(ctx.bnn.state.value("swag_period"))
        t = ((ctx.global_step % period) + 1) / period  # Izmailov et al.: t(i) = (mod(i−1, c) + 1)/c
        for group, base in zip(ctx.optimizer.param_groups, ctx.base_lrs):
            group["lr"] = (1.0 - t) * base + t * cfg.lr_min

    @torch.no_grad()
    def after_update(self, ctx: FitContext) -> None:
        """Snapshot θ every ``period`` optimiser steps (identical on every DDP rank)."""
        bnn = ctx.bnn
        if ctx.global_step % int(bnn.state.value("swag_period")) == 0:
            for layer in state.layers(bnn).values():
                layer.moments.update({k: v.detach() for k, v in layer.theta.items()})

    def end(self, ctx: FitContext) -> dict[str, Any]:
        """θ ← θ̄; BatchNorm statistics of θ̄ and of the stored members (from this rank's
        share of the training data, averaged over the ranks)."""
        bnn = ctx.bnn
        layers = state.layers(bnn)
        taken = post.snapshots(layers)
        if taken == 0:
            raise BayesifyError("no SWAG snapshot was collected; raise epochs or lower "
                                "snapshot_every / snapshot_every_steps")
        with torch.no_grad():
            for layer in layers.values():
                for key, value in layer.theta.items():
                    value.copy_(layer.moments.mean(key).to(value.device, value.dtype))
        bnn.runtime[state.BN_SOURCE] = ctx.source()
        bnn.state.set("swag_fitted", 1)
        record = state.choose_batchnorm(bnn, self.config, ctx,
                                        ctx.labelled_rows(state.BN_ROWS))
        state.store_batchnorm(bnn, self.config)
        return {"snapshots": taken, "rank": post.collected_rank(layers),
                "scale": state.scale(bnn), **record}


@torch.no_grad()
def start_state(bnn: BayesianModel) -> dict[str, torch.Tensor]:
    """The starting network as a fitted SWAG posterior of zero spread (``state_dict`` keys):
    θ̄ = θ₀, one snapshot (mean θ₀, mean of squares θ₀², no deviations), the pretrained
    BatchNorm statistics for θ̄ and every member, temperature 1. What ``fit``'s never-worse
    rule (:mod:`bayesify.train.best`) hands back when the SGD trajectory ended clearly worse
    than its start: the iterates are averaged, not rewound step by step."""
    out: dict[str, torch.Tensor] = {}
    for name, module in bnn.named_modules():
        if isinstance(module, SWAGLayer):
            for pname in module.param_names:
                key = pname.replace(".", "__")
                theta0 = module.base_layer.get_parameter(pname).detach()
                mean = module.moments.mean(key)
                out[f"{name}.theta.{key}"] = theta0.clone()
                out[f"{name}.moments.{key}_mean"] = theta0.to(mean.device, mean.dtype).clone()
                out[f"{name}.moments.{key}_sq_mean"] = out[f"{name}.moments.{key}_mean"].square()
                out[f"{name}.moments.{key}_dev"] = torch.zeros_like(getattr(module.moments,
                                                                             f"{key}_dev"))
            out[f"{name}.moments.count"] = torch.ones_like(module.moments.count)
        elif isinstance(module, SWAGBatchNorm):
            base = module.base_layer
            out[f"{name}.running_mean"] = base.running_mean.detach().clone()
            out[f"{name}.running_var"] = base.running_var.detach().clone()
            out[f"{name}.member_mean"] = base.running_mean.detach().expand_as(
                module.member_mean).clone()
            out[f"{name}.member_var"] = base.running_var.detach().expand_as(
                module.member_var).clone()
    current = bnn.state_dict()
    for key, value in {"state.temperature": 1, "state.swag_fitted": 1,
                       "state.swag_bn_members": 1}.items():
        out[key] = torch.full_like(current[key], value)
    return out
