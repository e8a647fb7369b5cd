"""SWAG family: SGD from the pretrained weights, moments collection, sampled networks.

The one training loop (``training = "snapshot"``) runs SGD on each wrapped layer's
working copy ``theta`` (the base weights never change); ``after_step`` snapshots
every k steps (or fraction of an epoch) into each layer's :class:`SWAGMoments`.
``finish_fit`` sets ``theta`` to the running mean θ̄ (so ``bnn(x)`` is the SWA
network), recomputes the BatchNorm statistics of θ̄ and of the default predictor's
N members into :class:`SWAGBatchNorm` buffers, and chooses the covariance scale on
the validation split when one is given. Prediction draws N networks from the
member seeds and evaluates them with ``torch.func.functional_call`` in vmapped
chunks. Everything a predictor needs is a buffer or parameter: saved generically.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call, vmap

from bayesify.core.batch import Batch, batch_rows, call_model
from bayesify.core.layers import BayesianLayer
from bayesify.core.method import Method
from bayesify.core.outputs import logits_of
from bayesify.errors import BayesifyError
from bayesify.methods.swag import posterior as post
from bayesify.methods.swag.batchnorm import recompute_batchnorm
from bayesify.methods.swag.config import SWAGConfig
from bayesify.methods.swag.export import export_swag
from bayesify.methods.swag.layers import SWAGBatchNorm, SWAGLayer, swag_batchnorm_wrappers

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

SnapshotCallback = Callable[[int, dict[str, torch.Tensor]], None]


class SWAGMethod(Method):
    """SWA / SWAG-diagonal / SWAG around the pretrained weights (SGD snapshots)."""

    name = "swag"
    config_cls = SWAGConfig
    training = "snapshot"
    unsupported_fit_options = ("kl_anneal_epochs", "beta", "optimizer")
    wrappers: ClassVar = {
        nn.Linear: SWAGLayer,
        nn.Conv1d: SWAGLayer,
        nn.Conv2d: SWAGLayer,
        nn.Conv3d: SWAGLayer,
        nn.ConvTranspose1d: SWAGLayer,
        nn.ConvTranspose2d: SWAGLayer,
        nn.ConvTranspose3d: SWAGLayer,
    }

    def __init__(self, config: SWAGConfig) -> None:
        super().__init__(config)
        #: loader of the BatchNorm recomputation for predictors other than the stored
        #: one (another seed or more members); runtime only, never saved
        self.bn_loader: Iterable | None = None
        self.batch_fn: Any = None
        self._bn_cache: dict[tuple[int | None, int], list[dict[str, torch.Tensor]]] = {}
        self._vmap_ok = config.vectorize

    def unsupported_reason(self) -> str:
        return "SWAG collects the iterates of plain SGD (no KL term, no other optimiser)"

    # -- structure and state --------------------------------------------------------
    def extra_wrappers(self, model: nn.Module, context: Any,
                       targets: list[str]) -> dict[str, BayesianLayer]:
        """BatchNorm statistics belong to the posterior: one :class:`SWAGBatchNorm` each."""
        return dict(swag_batchnorm_wrappers(model, context, self.config.predict_samples, targets))

    def prepare(self, bnn: BayesianModel) -> None:
        bnn.state.add("swag_scale", torch.tensor(self.config.sample_scale, dtype=torch.float64))
        bnn.state.add("swag_period", torch.zeros((), dtype=torch.long))
        #: whether member_mean/var of the BatchNorm wrappers hold the seed-0 members
        bnn.state.add("swag_bn_members", torch.zeros((), dtype=torch.long))
        #: 1 once fit finished: until then the predictive is the current iterate θ
        bnn.state.add("swag_fitted", torch.zeros((), dtype=torch.long))

    def scale(self, bnn: BayesianModel) -> float:
        return bnn.state.value("swag_scale")

    def fit_defaults(self) -> dict[str, Any]:
        cfg: SWAGConfig = self.config
        return {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay}

    # -- the snapshot step ------------------------------------------------------------
    def begin_fit(self, bnn: BayesianModel, *, steps_per_epoch: int, epochs: int) -> None:
        cfg: SWAGConfig = self.config
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
        for layer in self._layers(bnn).values():
            layer.moments.reset()

    def before_step(self, bnn: BayesianModel, state: Any) -> None:
        cfg: SWAGConfig = self.config
        if cfg.lr_schedule != "cyclic":
            return
        period = int(bnn.state.value("swag_period"))
        t = ((state.global_step % period) + 1) / period  # Izmailov et al.: t(i) = (mod(i−1, c) + 1)/c
        for group, base in zip(state.optimizer.param_groups, state.base_lrs):
            group["lr"] = (1.0 - t) * base + t * cfg.lr_min

    @torch.no_grad()
    def after_step(self, bnn: BayesianModel, state: Any) -> None:
        """Snapshot θ every ``period`` optimiser steps (identical on every DDP rank)."""
        if state.global_step % int(bnn.state.value("swag_period")) == 0:
            for layer in self._layers(bnn).values():
                layer.moments.update({k: v.detach() for k, v in layer.theta.items()})

    def finish_fit(self, bnn: BayesianModel, *, train_loader: Any, val_loader: Any, ctx: Any,
                   batch_fn: Any = None) -> dict[str, Any]:
        """θ ← θ̄; BatchNorm statistics of θ̄ and of the stored members; scale on validation."""
        layers = self._layers(bnn)
        taken = post.snapshots(layers)
        if taken == 0:
            raise BayesifyError("no SWAG snapshot was collected; raise epochs or lower "
                                "snapshot_every / snapshot_every_steps")
        with torch.no_grad():
            for layer in layers.values():
                for key, value in layer.theta.items():
                    value.copy_(layer.moments.mean(key).to(value.device, value.dtype))
        self.bn_loader, self.batch_fn = train_loader, batch_fn  # this rank's shard
        bnn.state.set("swag_fitted", 1)
        self._store_batchnorm(bnn)
        record: dict[str, Any] = {"snapshots": taken, "rank": post.collected_rank(layers)}
        cfg: SWAGConfig = self.config
        if cfg.variant != "swa" and (cfg.scale_method == "val_nll"
                                     or (cfg.scale_method == "auto" and val_loader is not None)):
            if val_loader is None:
                raise BayesifyError("scale_method='val_nll' needs fit(..., val_loader=...)")
            record.update(self.select_scale(bnn, val_loader, batch_fn=batch_fn))
        record["scale"] = self.scale(bnn)
        return record

    @torch.no_grad()
    def _store_batchnorm(self, bnn: BayesianModel) -> None:
        """Recompute the BatchNorm statistics of θ̄ and of the seed-0 members into the
        :class:`SWAGBatchNorm` buffers (so reloaded posteriors need no data)."""
        wrappers = self._bn_wrappers(bnn)
        if not wrappers or self.bn_loader is None or self.config.bn_update_fraction == 0:
            return
        mean_stats = self._recompute(bnn, {})
        for name, w in wrappers.items():
            w.running_mean.copy_(mean_stats[f"{name}.running_mean"])
            w.running_var.copy_(mean_stats[f"{name}.running_var"])
        self._bn_cache.clear()
        if self.config.variant != "swa":
            for m, stats in enumerate(self.member_batchnorm(bnn, self.config.predict_samples, 0)):
                for name, w in wrappers.items():
                    w.member_mean[m].copy_(stats[f"{name}.running_mean"])
                    w.member_var[m].copy_(stats[f"{name}.running_var"])
            bnn.state.set("swag_bn_members", 1)

    def _recompute(self, bnn: BayesianModel, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Statistics of the network at ``params`` keyed ``"<bn>.running_mean"`` etc."""
        stats = recompute_batchnorm(bnn.model, params, self.bn_loader,
                                    fraction=self.config.bn_update_fraction, device=bnn.device,
                                    batch_fn=self.batch_fn)
        return {k.replace(".base_layer.", "."): v for k, v in stats.items()
                if not k.endswith("num_batches_tracked")}

    # -- sampling ----------------------------------------------------------------------
    def sample(self, bnn: BayesianModel, member: int, seed: int | None = 0) -> dict[str, torch.Tensor]:
        """Sampled parameters of predictive member ``member`` (reproducible from ``seed``)."""
        cfg: SWAGConfig = self.config
        return post.sample_parameters(
            self._layers(bnn), variant=cfg.variant, scale=self.scale(bnn),
            generator=post.member_generator(seed, member), device=bnn.device,
            min_variance=cfg.min_variance,
        )

    @torch.no_grad()
    def select_scale(self, bnn: BayesianModel, val_loader: Iterable, *,
                     batch_fn: Any = None) -> dict[str, Any]:
        """Covariance scale on a log grid by validation NLL of the predictive (shared
        search, :func:`bayesify.core.selection.select_on_validation`; the broadest scale
        within the rule). Stored in ``bnn.state``."""
        from bayesify.core.selection import select_on_validation

        cfg: SWAGConfig = self.config

        def set_scale(scale: float) -> None:
            bnn.state.set("swag_scale", scale)
            self._bn_cache.clear()

        choice = select_on_validation(bnn, val_loader, set_knob=set_scale, grid=cfg.scale_grid,
                                      rule=cfg.val_rule, prefer="largest", batch_fn=batch_fn,
                                      name="swag_scale")
        self._store_batchnorm(bnn)
        return choice

    def member_batchnorm(self, bnn: BayesianModel, num_members: int, seed: int | None) -> list[dict[str, torch.Tensor]]:
        """BatchNorm statistics of every sampled member (recomputed once, then cached)."""
        key = (seed, num_members)
        wrappers = self._bn_wrappers(bnn)
        if key in self._bn_cache:
            return self._bn_cache[key]
        if not wrappers or self.config.bn_update_fraction == 0:
            stats = [{}] * num_members
        elif (seed == 0 and num_members <= self.config.predict_samples
              and bnn.state.value("swag_bn_members") and self.bn_loader is None):
            stats = [{f"{n}.running_mean": w.member_mean[m] for n, w in wrappers.items()}
                     | {f"{n}.running_var": w.member_var[m] for n, w in wrappers.items()}
                     for m in range(num_members)]
        elif self.bn_loader is None:
            raise BayesifyError(
                f"SWAG stored BatchNorm statistics for {self.config.predict_samples} members of "
                f"seed 0; a predictor with seed={seed} and {num_members} members needs them "
                "recomputed: set bnn.method.bn_loader = <training loader> first"
            )
        else:
            stats = [self._recompute(bnn, self.sample(bnn, m, seed)) for m in range(num_members)]
        self._bn_cache[key] = stats
        return stats

    def default_samples_per_component(self) -> int:
        return 1 if self.config.variant == "swa" else self.config.predict_samples

    # -- prediction ----------------------------------------------------------------------
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
        """``[M, B, C]``: M = N sampled networks (1 for 'swa' or ``deterministic``: θ̄)."""
        if (deterministic or self.config.variant == "swa"
                or not bnn.state.value("swag_fitted")):
            return logits_of(call_model(bnn.model, x)).unsqueeze(0)
        num = samples_per_component
        bn_stats = self.member_batchnorm(bnn, num, seed)
        per_param = max(1, 2**27 // max(1, sum(layer.num_nodes() for layer in self._layers(bnn).values())))
        per_chunk = max(1, min(max_rows // max(batch_rows(x), 1), per_param))
        outs = []
        for start in range(0, num, per_chunk):
            ids = range(start, min(start + per_chunk, num))
            states = [{**self.sample(bnn, m, seed), **bn_stats[m]} for m in ids]
            outs.append(self._evaluate(bnn.model, states, x))
        return torch.cat(outs, dim=0)

    def _evaluate(self, model: nn.Module, states: list[dict[str, torch.Tensor]], x: Any) -> torch.Tensor:
        """``[m, B, C]`` logits of m networks given as functional_call state dicts."""
        args, kwargs = (x.args, x.kwargs) if isinstance(x, Batch) else ((x,), {})
        if self._vmap_ok and len(states) > 1:
            stacked = {k: torch.stack([s[k] for s in states]) for k in states[0]}
            try:
                return vmap(lambda s: logits_of(functional_call(model, s, args, kwargs)))(stacked)
            except Exception as err:  # noqa: BLE001 - arbitrary user models may not vmap
                warnings.warn(f"SWAG: vmap over sampled networks failed ({err}); "
                              "evaluating them one by one", stacklevel=3)
                self._vmap_ok = False
        return torch.stack([logits_of(functional_call(model, s, args, kwargs)) for s in states])

    def export_module(self, bnn: BayesianModel, *, samples_per_component: int, seed: int,
                      example_input: torch.Tensor) -> nn.Module:
        """``x → [N, B, C]``: the N sampled networks (weights + recomputed BatchNorm) as
        plain copies; see :mod:`bayesify.methods.swag.export`."""
        return export_swag(self, bnn, samples_per_component=samples_per_component, seed=seed,
                           example_input=example_input,
                           deterministic=bnn.context.force_deterministic)

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _layers(bnn: BayesianModel) -> dict[str, SWAGLayer]:
        return {n: m for n, m in bnn.bayesian_layers().items() if isinstance(m, SWAGLayer)}

    @staticmethod
    def _bn_wrappers(bnn: BayesianModel) -> dict[str, SWAGBatchNorm]:
        return {n: m for n, m in bnn.bayesian_layers().items() if isinstance(m, SWAGBatchNorm)}

def _first(layers: dict[str, SWAGLayer]) -> SWAGLayer:
    return next(iter(layers.values()))

