"""SWAG family: SGD from the pretrained weights, moments collection, sampled networks.

``fit`` runs SGD on the wrapped parameters with the trainer's batch layout
(``bnn.training_forward``), snapshots every k steps (or fraction of an epoch) into
each layer's :class:`SWAGMoments`, then installs the running mean θ̄ as the base
weights with recomputed BatchNorm statistics (so ``bnn(x)`` is the SWA network).
Prediction draws N networks from the member seeds, recomputes BatchNorm for each
(cached), and evaluates them with ``torch.func.functional_call`` in vmapped chunks.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap
from tqdm.auto import tqdm

from bayesify.core.method import Method, logits_of
from bayesify.errors import BayesifyError, NonFiniteLossError
from bayesify.methods.swag import posterior as post
from bayesify.methods.swag.batchnorm import batchnorm_state, recompute_batchnorm
from bayesify.methods.swag.config import SWAGConfig
from bayesify.methods.swag.export import export_swag
from bayesify.methods.swag.layers import SWAGLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

SnapshotCallback = Callable[[int, dict[str, torch.Tensor]], None]


class SWAGMethod(Method):
    """SWA / SWAG-diagonal / SWAG around the pretrained weights (post-hoc, not ELBO-trained)."""

    name = "swag"
    config_cls = SWAGConfig
    gradient_trained = False
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
        self.bn_loader: Iterable | None = None
        self._bn_cache: dict[tuple[int | None, int], list[dict[str, torch.Tensor]]] = {}
        self._vmap_ok = config.vectorize
        self.scale = config.sample_scale  # the covariance scale in use (fit may choose it)

    # -- fitting ---------------------------------------------------------------------
    def fit(
        self,
        bnn: BayesianModel,
        loader: Iterable,
        *,
        epochs: int = 1,
        lr: float | None = None,
        device: torch.device | None = None,
        progress: bool = True,
        snapshot_callback: SnapshotCallback | None = None,
        bn_loader: Iterable | None = None,
        val_loader: Iterable | None = None,
        **unknown: Any,
    ) -> dict[str, Any]:
        """Collect SWAG moments along an SGD run of ``epochs`` over ``loader``.

        ``snapshot_callback(t, {name: θ_t})`` is called after every snapshot (for
        logging or a naive reference). ``bn_loader`` (default ``loader``) feeds the
        BatchNorm recomputation of every sampled network. ``val_loader`` feeds the
        scale choice of ``scale_method='val_nll'`` (see :meth:`select_scale`).
        """
        if unknown:
            raise BayesifyError(f"unknown fit option(s) {sorted(unknown)} for method 'swag'; "
                                "valid: snapshot_callback, bn_loader, val_loader")
        cfg: SWAGConfig = self.config
        layers = self._layers(bnn)
        device = device or bnn.device
        params = {name: layer.base_layer.get_parameter(name.rsplit(".", 1)[1])
                  for name, layer, _ in post.parameter_keys(layers)}
        steps_per_epoch = _num_batches(loader)
        period = cfg.snapshot_every_steps or max(1, round(cfg.snapshot_every * max(steps_per_epoch, 1)))
        base_lr = cfg.lr if lr is None else float(lr)
        for layer in layers.values():
            layer.moments.reset()
        flags = {name: p.requires_grad for name, p in bnn.model.named_parameters()}
        for p in bnn.model.parameters():
            p.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)
        opt = torch.optim.SGD(list(params.values()), lr=base_lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay)
        start, step, losses = time.perf_counter(), 0, []
        bar = tqdm(total=epochs * steps_per_epoch or None, desc="swag", disable=not progress,
                   leave=False, dynamic_ncols=True)
        bnn.train()
        try:
            for epoch in range(epochs):
                for x, y in _batches(loader, device):
                    for group in opt.param_groups:
                        group["lr"] = self._lr_at(step, period, base_lr)
                    loss = self._sgd_step(bnn, opt, params, x, y, epoch, step)
                    losses.append(loss)
                    step += 1
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}", snapshots=int(_first(layers).moments.count))
                    if step % period == 0:
                        self._snapshot(layers, params, snapshot_callback)
        finally:
            bar.close()
            for name, p in bnn.model.named_parameters():
                p.requires_grad_(flags[name])
            bnn.eval()
        if step == 0:
            raise BayesifyError("the training loader produced no batches")
        taken = post.snapshots(layers)
        if taken == 0:
            raise BayesifyError(
                f"no SWAG snapshot was collected in {step} SGD steps (one every {period}); "
                "raise epochs or lower snapshot_every / snapshot_every_steps"
            )
        self.install_mean(bnn, bn_loader or loader)
        self.scale = cfg.sample_scale
        if cfg.scale_method == "val_nll":
            if val_loader is None:
                raise BayesifyError("scale_method='val_nll' needs fit(..., val_loader=...) "
                                    "(a held-out split); or use scale_method='fixed'")
            self.select_scale(bnn, val_loader)
        return {"scale": self.scale, "snapshots": taken, "rank": post.collected_rank(layers), "steps": step,
                "snapshot_period_steps": period, "loss": sum(losses) / len(losses),
                "seconds": time.perf_counter() - start}

    def _lr_at(self, step: int, period: int, base_lr: float) -> float:
        cfg: SWAGConfig = self.config
        if cfg.lr_schedule == "constant":
            return base_lr
        t = ((step % period) + 1) / period  # Izmailov et al.: t(i) = (mod(i−1, c) + 1)/c
        return (1.0 - t) * base_lr + t * cfg.lr_min

    def _sgd_step(self, bnn: BayesianModel, opt: torch.optim.Optimizer,
                  params: dict[str, nn.Parameter], x: torch.Tensor, y: torch.Tensor,
                  epoch: int, step: int) -> float:
        logits, targets = bnn.training_forward(x, y)
        loss = F.cross_entropy(logits.float(), targets)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"non-finite SWAG loss at epoch {epoch}, step {step}; lower lr (now "
                f"{opt.param_groups[0]['lr']:.3g}) or check the inputs for NaN/inf"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in params.values():  # what DDP would do: every rank takes the same step
            if p.grad is not None:
                post.all_reduce_mean_(p.grad)
        opt.step()
        return loss.item()

    @torch.no_grad()
    def _snapshot(self, layers: dict[str, SWAGLayer], params: dict[str, nn.Parameter],
                  callback: SnapshotCallback | None) -> None:
        values = {name: post.all_reduce_mean_(p.detach().clone()) for name, p in params.items()}
        by_layer: dict[str, dict[str, torch.Tensor]] = {}
        for name, layer, key in post.parameter_keys(layers):
            by_layer.setdefault(name.split(".base_layer.")[0], {})[key] = values[name]
        for lname, layer in layers.items():
            layer.moments.update(by_layer[lname])
        if callback is not None:
            callback(post.snapshots(layers), values)

    @torch.no_grad()
    def install_mean(self, bnn: BayesianModel, bn_loader: Iterable | None) -> None:
        """Base weights ← θ̄ and BatchNorm statistics of θ̄, so ``bnn(x)`` is the SWA network."""
        layers = self._layers(bnn)
        for name, layer, key in post.parameter_keys(layers):
            param = layer.base_layer.get_parameter(name.rsplit(".", 1)[1])
            param.copy_(layer.moments.mean(key).to(param.device, param.dtype))
        self.bn_loader = bn_loader
        self._bn_cache.clear()
        if bn_loader is not None and self.config.bn_update_fraction > 0:
            stats = recompute_batchnorm(bnn.model, {}, bn_loader,
                                        fraction=self.config.bn_update_fraction, device=bnn.device)
            for key, value in stats.items():
                bnn.model.get_buffer(key).copy_(value)

    # -- sampling ----------------------------------------------------------------------
    def sample(self, bnn: BayesianModel, member: int, seed: int | None = 0) -> dict[str, torch.Tensor]:
        """Sampled parameters of predictive member ``member`` (reproducible from ``seed``)."""
        cfg: SWAGConfig = self.config
        return post.sample_parameters(
            self._layers(bnn), variant=cfg.variant, scale=self.scale,
            generator=post.member_generator(seed, member), device=bnn.device,
            min_variance=cfg.min_variance,
        )

    @torch.no_grad()
    def select_scale(self, bnn: BayesianModel, val_loader: Iterable) -> float:
        """Covariance scale on a log grid by validation NLL of the predictive; sets ``self.scale``.

        Per scale s: ``nll_i(s) = −log (1/N Σ_n softmax(f(x_i; θ_n(s)))_{y_i})`` with the
        N members of seed 0 (BatchNorm recomputed for each). Rule 'min': argmin of the mean;
        'one_se': the largest s with ``mean(s) ≤ mean(s*) + std(nll(s*)) / sqrt(n)`` (s* the
        argmin) — the broadest posterior the validation data cannot tell from the best.
        """
        cfg: SWAGConfig = self.config
        if cfg.variant == "swa":
            return self.scale
        low, high, count = cfg.scale_grid
        grid = torch.logspace(math.log10(low), math.log10(high), int(count), dtype=torch.float64).tolist()
        batches = [(b[0].to(bnn.device), b[1].to(bnn.device)) for b in val_loader]
        if not batches:
            raise BayesifyError("the validation loader of scale_method='val_nll' produced no batches")
        per_scale = []
        for scale in grid:
            self.scale = scale
            self._bn_cache.clear()
            nll = []
            for x, y in batches:
                members = self.member_logits(bnn, x, samples_per_component=self.default_samples_per_component(),
                                             max_rows=4096, seed=0)
                log_probs = torch.logsumexp(members.double().log_softmax(-1), 0) - math.log(members.shape[0])
                nll.append(F.nll_loss(log_probs, y, reduction="none"))
            per_scale.append(torch.cat(nll))
        self._bn_cache.clear()
        means = torch.stack([v.mean() for v in per_scale])
        best = int(means.argmin())
        if cfg.val_rule == "min":
            self.scale = grid[best]
        else:
            se = per_scale[best].std() / math.sqrt(per_scale[best].numel())
            self.scale = grid[int(torch.nonzero(means <= means[best] + se)[-1])]
        return self.scale

    def member_batchnorm(self, bnn: BayesianModel, num_members: int, seed: int | None) -> list[dict[str, torch.Tensor]]:
        """BatchNorm statistics of every sampled member (recomputed once, then cached)."""
        key = (seed, num_members)
        if key not in self._bn_cache:
            if self.bn_loader is None or self.config.bn_update_fraction == 0:
                stats = [batchnorm_state(bnn.model)] * num_members
            else:
                stats = [recompute_batchnorm(bnn.model, self.sample(bnn, m, seed), self.bn_loader,
                                             fraction=self.config.bn_update_fraction,
                                             device=bnn.device)
                         for m in range(num_members)]
            self._bn_cache[key] = stats
        return self._bn_cache[key]

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
        if deterministic or self.config.variant == "swa" or post.snapshots(self._layers(bnn)) == 0:
            return logits_of(bnn.model(x)).unsqueeze(0)
        num = samples_per_component
        bn_stats = self.member_batchnorm(bnn, num, seed)
        per_param = max(1, 2**27 // max(1, sum(layer.num_nodes() for layer in self._layers(bnn).values())))
        per_chunk = max(1, min(max_rows // max(x.shape[0], 1), per_param))
        outs = []
        for start in range(0, num, per_chunk):
            ids = range(start, min(start + per_chunk, num))
            states = [{**self.sample(bnn, m, seed), **bn_stats[m]} for m in ids]
            outs.append(self._evaluate(bnn.model, states, x))
        return torch.cat(outs, dim=0)

    def _evaluate(self, model: nn.Module, states: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        """``[m, B, C]`` logits of m networks given as functional_call state dicts."""
        if self._vmap_ok and len(states) > 1:
            stacked = {k: torch.stack([s[k] for s in states]) for k in states[0]}
            try:
                return vmap(lambda s: logits_of(functional_call(model, s, (x,))))(stacked)
            except Exception as err:  # noqa: BLE001 - arbitrary user models may not vmap
                warnings.warn(f"SWAG: vmap over sampled networks failed ({err}); "
                              "evaluating them one by one", stacklevel=3)
                self._vmap_ok = False
        return torch.stack([logits_of(functional_call(model, s, (x,))) for s in states])

    def export_module(self, bnn: BayesianModel, *, samples_per_component: int, seed: int,
                      example_input: torch.Tensor) -> nn.Module:
        """``x → [N, B, C]``: the N sampled networks (weights + recomputed BatchNorm) as
        plain copies; see :mod:`bayesify.methods.swag.export`."""
        return export_swag(self, bnn, samples_per_component=samples_per_component, seed=seed,
                           example_input=example_input,
                           deterministic=bnn.context.force_deterministic)

    # -- persistence -----------------------------------------------------------------------
    def posterior_state(self, bnn: BayesianModel) -> dict[str, torch.Tensor]:
        """SWAG moments keyed ``"<module>.<param>_mean"`` etc. (base-model module names),
        plus ``"swag.scale"``: the covariance scale in use (fit may have chosen it)."""
        state = {f"{lname}.{key}": value for lname, layer in self._layers(bnn).items()
                 for key, value in layer.moments.state_dict().items()}
        state["swag.scale"] = torch.tensor([self.scale], dtype=torch.float64)
        return state

    def load_posterior_state(self, bnn: BayesianModel, state: dict[str, torch.Tensor]) -> None:
        for lname, layer in self._layers(bnn).items():
            prefix = f"{lname}."
            layer.moments.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                           if k.startswith(prefix)})
        if "swag.scale" in state:
            self.scale = float(state["swag.scale"][0])
        self._bn_cache.clear()

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _layers(bnn: BayesianModel) -> dict[str, SWAGLayer]:
        return {n: m for n, m in bnn.bayesian_layers().items() if isinstance(m, SWAGLayer)}

    @classmethod
    def demo_recipe(cls) -> dict[str, Any]:
        return {
            # SGD from a ~zero-loss MAP barely moves (deviations ≈ 0.4 % of ‖θ‖), so the
            # paper's scale 0.5 gives a near-point posterior; the scale is chosen on the
            # validation split with the one-SE rule (as the Laplace recipe chooses τ).
            "options": {"variant": "swag", "lr": 0.02, "snapshot_every": 0.5, "weight_decay": 5e-4,
                        "scale_method": "val_nll", "val_rule": "one_se"},
            "fit": {"epochs": 10, "val_loader": "val"},
            "predictor": {"samples_per_component": 20},
        }


def _first(layers: dict[str, SWAGLayer]) -> SWAGLayer:
    return next(iter(layers.values()))


def _batches(loader: Iterable, device: torch.device):
    for batch in loader:
        yield batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)


def _num_batches(loader: Iterable) -> int:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return 0
