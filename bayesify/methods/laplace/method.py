"""Laplace family: GGN curvature in one data pass, prior precision by evidence or val NLL,
linearised (GLM) predictive with probit / bridge / MC link.

Two modes, chosen from the targets:

* **last layer** (one Linear target whose output is the model's logits): curvature
  from the features captured by the wrapper's forward (``kron``, ``diag``, ``full``);
* **subnetwork** (any other targets, ``structure='diag'``): per-example Jacobians with
  ``torch.func`` (exact GGN diagonal, or a sampled Fisher).

Prediction returns ``[M, B, C]`` "member logits": for probit/bridge M = 1 and the
logits *are* the log predictive probabilities; for MC, M samples of the GLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bayesify.core.batch import call_model
from bayesify.core.checks import check_finite_inputs, check_finite_logits, check_labels
from bayesify.core.method import Method
from bayesify.core.outputs import logits_of
from bayesify.errors import BayesifyError
from bayesify.methods.laplace import curvature as curv
from bayesify.methods.laplace import posterior as post
from bayesify.methods.laplace.config import LaplaceConfig
from bayesify.methods.laplace.export import export_laplace
from bayesify.methods.laplace.layers import LaplaceLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

_LAST_LAYER_POSTERIORS = {"kron": post.LastLayerKron, "diag": post.LastLayerDiag,
                          "full": post.LastLayerFull}


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over DDP ranks (no-op without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class LaplaceMethod(Method):
    """Laplace approximation around the pretrained (MAP) weights; post-hoc."""

    name = "laplace"
    config_cls = LaplaceConfig
    training = "curvature"
    unsupported_fit_options = ("lr", "base_lr", "kl_anneal_epochs", "beta", "optimizer",
                               "momentum", "weight_decay", "lr_schedule", "grad_accum_steps",
                               "clip_grad_norm", "epochs", "compile", "channels_last",
                               "checkpoint_every_steps", "amp")
    wrappers: ClassVar = {nn.Linear: LaplaceLayer, nn.Conv1d: LaplaceLayer,
                          nn.Conv2d: LaplaceLayer, nn.Conv3d: LaplaceLayer}

    def __init__(self, config: LaplaceConfig) -> None:
        super().__init__(config)
        self._state: Any = None  # bnn.state, where the fitted values live (buffers)
        self._posterior: Any = None  # a view over the curvature buffers (cache)

    def unsupported_reason(self) -> str:
        return "Laplace is fitted by one gradient-free curvature pass over the data"

    def validate_plan(self, model: nn.Module, targets: list[str]) -> None:
        modules = dict(model.named_modules())
        single_linear = len(targets) == 1 and isinstance(modules[targets[0]], nn.Linear)
        if self.config.structure in ("kron", "full") and not single_linear:
            raise BayesifyError(
                f"structure={self.config.structure!r} needs exactly one Linear target (the "
                f"classifier, targets='last_layer'); got {list(targets)[:5]}. Use "
                "structure='diag' for a subnetwork"
            )

    def prepare(self, bnn: BayesianModel) -> None:
        layers = self._layers(bnn)
        single_linear = len(layers) == 1 and isinstance(_first(layers).base_layer, nn.Linear)
        bnn.state.add("laplace_last_layer", torch.tensor(int(single_linear)))
        bnn.state.add("laplace_fitted", torch.tensor(0))
        bnn.state.add("laplace_train_loss", torch.zeros((), dtype=torch.float64))
        self._state = bnn.state

    @property
    def last_layer(self) -> bool:
        return bool(self._state.value("laplace_last_layer"))

    @last_layer.setter
    def last_layer(self, value: bool) -> None:
        self._state.set("laplace_last_layer", int(value))

    @property
    def train_loss(self) -> torch.Tensor | None:
        """Σ cross-entropy at θ* over the training data (None before ``fit``)."""
        if not self._state.value("laplace_fitted"):
            return None
        return self._state.get_buffer("laplace_train_loss")

    # -- the curvature step of the one loop --------------------------------------------
    def begin_fit(self, bnn: BayesianModel, *, steps_per_epoch: int, epochs: int) -> None:
        for layer in self._layers(bnn).values():
            layer.reset_curvature()
        bnn.state.set("laplace_train_loss", 0.0)
        bnn.state.set("laplace_fitted", 0)
        self._posterior = None

    @torch.no_grad()
    def accumulate(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """Add one batch's GGN to the layers' buffers and its summed loss to the state.
        Last layer: one no-grad forward, features captured by the wrapper."""
        check_finite_inputs(inputs.args + tuple(inputs.kwargs.values()) if hasattr(inputs, "args")
                            else inputs, where="laplace fit")
        layers = self._layers(bnn)
        first = _first(layers)
        dtype = first.n_data.dtype
        if self.last_layer:
            with _capturing(first):
                logits = logits_of(call_model(bnn.model, inputs))
                feats = self._features(first, logits, check=True)
                if feats is not None:
                    check_finite_logits(logits, where="laplace fit")
                    self._last_layer_batch(first, feats.to(dtype), logits.to(dtype).softmax(-1))
            if feats is None:  # diag on a layer that is not the logits: Jacobian path
                self.last_layer = False
                with torch.enable_grad():
                    logits = self._subnetwork_batch(bnn, layers, inputs)
        else:
            with torch.enable_grad():
                logits = self._subnetwork_batch(bnn, layers, inputs)
        check_finite_logits(logits, where="laplace fit")
        labels = check_labels(labels, logits.shape[-1], where="laplace fit")
        loss = F.cross_entropy(logits.double(), labels, reduction="sum")
        total = bnn.state.get_buffer("laplace_train_loss")
        total.add_(loss.to(total.device, total.dtype))
        for layer in layers.values():
            layer.n_data.add_(labels.shape[0])
        return loss

    def finish_fit(self, bnn: BayesianModel, *, train_loader: Any, val_loader: Any, ctx: Any,
                   batch_fn: Any = None) -> dict[str, Any]:
        """Sum curvature, loss and counts over DDP ranks; then τ by ``prior_method``."""
        cfg: LaplaceConfig = self.config
        for layer in self._layers(bnn).values():
            for name, buffer in layer.named_buffers():
                if not name.startswith("base_layer.") and name != "prior_precision":
                    all_reduce_sum_(buffer)
        all_reduce_sum_(bnn.state.get_buffer("laplace_train_loss"))
        bnn.state.set("laplace_fitted", 1)
        self._posterior = None
        info: dict[str, Any] = {"n_data": float(_first(self._layers(bnn)).n_data),
                                "train_loss": float(self.train_loss)}
        if cfg.prior_method == "val_nll" and val_loader is None:
            raise BayesifyError("prior_method='val_nll' needs fit(..., val_loader=...)")
        info.update(self.tune_prior(bnn, val_loader=val_loader, batch_fn=batch_fn))
        return info

    def _features(self, layer: LaplaceLayer, logits: torch.Tensor, *, check: bool) -> torch.Tensor | None:
        """ã ``[B, D']`` from the captured input, after checking the layer makes the logits."""
        a, out = layer.captured
        if check and (a.dim() != 2 or out.shape != logits.shape or not torch.equal(out, logits)):
            if self.config.structure != "diag":
                raise BayesifyError(
                    "last-layer Laplace needs the wrapped Linear to produce the model's logits "
                    f"from [B, D] features (saw input {tuple(a.shape)}, output {tuple(out.shape)}, "
                    f"logits {tuple(logits.shape)}); name the classifier in targets=[...] or use "
                    "structure='diag'"
                )
            return None
        return curv.augmented_features(a, layer.has_bias)

    @staticmethod
    def _last_layer_batch(layer: LaplaceLayer, feats: torch.Tensor, probs: torch.Tensor) -> None:
        if layer.structure == "kron":
            a, g = curv.kron_factors(feats, probs)
            layer.kron_input.add_(a)
            layer.kron_output.add_(g)
        elif layer.structure == "diag":
            layer.ggn_diag.add_(curv.last_layer_diag(feats, probs, layer.has_bias))
        else:
            layer.ggn_full.add_(curv.last_layer_full(feats, probs))

    def _subnetwork_batch(self, bnn: BayesianModel, layers: dict[str, LaplaceLayer],
                          x: torch.Tensor) -> torch.Tensor:
        """Accumulate the diagonal GGN of a batch; returns its logits ``[B, C]``."""
        cfg: LaplaceConfig = self.config
        params = curv.subnetwork_parameters(bnn.model, self._param_names(layers))
        h = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float64, device=x.device)
        outs = []
        if cfg.diag_ggn == "mc":
            with torch.no_grad():
                logits = logits_of(bnn.model(x))
            h += curv.fisher_diag_sampled(bnn.model, params, x, logits.softmax(-1),
                                          samples=cfg.ggn_samples).double()
            outs.append(logits)
        else:
            for _, xc in curv.example_chunks(x, self._chunk(bnn, x, h.numel())):
                jac, f = curv.per_example_jacobians(bnn.model, params, xc)
                h += curv.ggn_diag_from_jacobians(jac.double(), f.double().softmax(-1))
                outs.append(f.detach())
        offset = 0
        for layer in layers.values():
            size = layer.num_params()
            layer.ggn_diag.add_(h[offset:offset + size].to(layer.ggn_diag.dtype))
            offset += size
        return torch.cat(outs)

    def _chunk(self, bnn: BayesianModel, x: torch.Tensor, num_params: int) -> int:
        classes = getattr(self, "_classes", None)
        if classes is None:
            with torch.no_grad():
                classes = self._classes = logits_of(bnn.model(x[:1])).shape[-1]
        return max(1, self.config.jacobian_chunk // max(1, classes * num_params))

    # -- prior precision ---------------------------------------------------------------
    def posterior(self, bnn: BayesianModel) -> Any:
        """The posterior view over the layers' curvature buffers (cached until the next fit)."""
        if self._posterior is None:
            layers = self._layers(bnn)
            if self.last_layer:
                self._posterior = _LAST_LAYER_POSTERIORS[self.config.structure](_first(layers))
            else:
                self._posterior = post.SubnetworkDiag(list(layers.values()))
        return self._posterior

    def prior_precision(self, bnn: BayesianModel) -> torch.Tensor:
        """τ: ``[1]`` (scalar) or ``[L]`` (one per wrapped layer)."""
        taus = torch.stack([layer.prior_precision for layer in self._layers(bnn).values()])
        return taus if self.config.prior_per_layer and len(taus) > 1 else taus[:1]

    def set_prior_precision(self, bnn: BayesianModel, tau: torch.Tensor | float) -> None:
        tau = torch.as_tensor(tau, dtype=torch.float64).reshape(-1)
        for i, layer in enumerate(self._layers(bnn).values()):
            layer.prior_precision.fill_(float(tau[i if tau.numel() > 1 else 0]))

    def log_marginal_likelihood(self, bnn: BayesianModel, tau: torch.Tensor | None = None) -> torch.Tensor:
        """Laplace evidence at τ (default: the current prior precision); differentiable in τ."""
        if self.train_loss is None:
            raise BayesifyError("call bayesify.fit(bnn, loader) before the marginal likelihood")
        posterior = self.posterior(bnn)
        layers = list(self._layers(bnn).values())
        tau = self.prior_precision(bnn) if tau is None else tau
        tau = tau.to(posterior.h.dtype if hasattr(posterior, "h") else posterior.eig.dtype)
        if self.last_layer:
            sq = posterior.mean.square().sum().reshape(1)
            sizes = [posterior.num_params]
        else:
            sq = torch.stack([layer.map_vector().detach().square().sum() for layer in layers])
            sizes = [layer.num_params() for layer in layers]
            if tau.numel() == 1:
                sq, sizes = sq.sum().reshape(1), [sum(sizes)]
        return post.log_marginal_likelihood(
            posterior.log_det(tau), tau, loss=self.train_loss.to(tau), map_sq_norms=sq.to(tau),
            sizes=sizes,
        )

    def tune_prior(self, bnn: BayesianModel, *, val_loader: Iterable | None = None,
                   batch_fn: Any = None) -> dict[str, Any]:
        """Choose τ by ``prior_method``; returns what was chosen (and the evidence)."""
        cfg: LaplaceConfig = self.config
        method = cfg.prior_method
        if method == "auto":
            method = "val_nll" if val_loader is not None else "marglik"
        record: dict[str, Any] = {"prior_method": method}
        if method == "marglik":
            count = len(self._layers(bnn)) if cfg.prior_per_layer else 1
            log_tau = torch.full((count,), math.log(cfg.prior_precision), dtype=torch.float64,
                                 device=bnn.device, requires_grad=True)
            opt = torch.optim.Adam([log_tau], lr=cfg.marglik_lr)
            for _ in range(cfg.marglik_steps):
                opt.zero_grad()
                (-self.log_marginal_likelihood(bnn, log_tau.exp())).backward()
                opt.step()
            self.set_prior_precision(bnn, log_tau.detach().exp())
        elif method == "val_nll":
            from bayesify.core.selection import select_on_validation

            record.update(select_on_validation(
                bnn, val_loader, set_knob=lambda tau: self.set_prior_precision(bnn, tau),
                grid=cfg.val_grid, rule=cfg.val_rule, prefer="smallest", batch_fn=batch_fn,
                name="prior_precision"))
        tau = self.prior_precision(bnn)
        with torch.no_grad():
            evidence = float(self.log_marginal_likelihood(bnn))
        record.update({"prior_precision": tau.tolist(), "log_marginal_likelihood": evidence})
        return record

    # -- prediction ------------------------------------------------------------------------
    def default_samples_per_component(self) -> int:
        return self.config.predict_samples if self.config.link == "mc" else 1

    def predictive(self, bnn: BayesianModel, x: Any, *, samples_per_component: int,
                   max_rows: int, seed: int | None = None, deterministic: bool = False) -> Any:
        """Linearised (GLM) predictive: a Gaussian over the logits ``(f*, diag Σ_f)``
        with the probit or bridge link applied last; MC samples for ``link='mc'``."""
        from bayesify.core.prediction import Prediction

        if deterministic or self.train_loss is None or self.config.link == "mc":
            return super().predictive(bnn, x, samples_per_component=samples_per_component,
                                      max_rows=max_rows, seed=seed, deterministic=deterministic)
        logits, fvar = self._moments(bnn, x)
        return Prediction(mean=logits.float(), variance=fvar[0].float(), link=self.config.link,
                          rowsum=fvar[1].float(), total=fvar[2].float())

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
        """``[M, B, C]``: the MAP logits (deterministic / not fitted), the MC samples of
        ``link='mc'``, else samples of the Gaussian predictive (see ``predictive``)."""
        if deterministic or self.train_loss is None:
            return logits_of(call_model(bnn.model, x)).unsqueeze(0)
        if self.config.link != "mc":
            return self.predictive(bnn, x, samples_per_component=samples_per_component,
                                   max_rows=max_rows, seed=seed).member_logits
        posterior = self.posterior(bnn)
        layers = self._layers(bnn)
        tau = self.prior_precision(bnn)
        if self.last_layer:
            _, feats = self._last_layer_features(bnn, x)
            return self._mc_last_layer(posterior, feats, tau, samples_per_component, max_rows, seed)
        params = curv.subnetwork_parameters(bnn.model, self._param_names(layers))
        pieces = []
        for _, xc in curv.example_chunks(x, self._chunk(bnn, x, posterior.num_params)):
            jac, f = curv.per_example_jacobians(bnn.model, params, xc)
            pieces.append(self._mc_subnetwork(posterior, jac.detach(), f.detach(), tau,
                                              samples_per_component, seed))
        return torch.cat(pieces, dim=1)

    def _last_layer_features(self, bnn: BayesianModel, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """MAP logits ``[B, C]`` and the augmented features ã ``[B, D']`` of the classifier."""
        layer = _first(self._layers(bnn))
        with _capturing(layer):
            logits = logits_of(call_model(bnn.model, x))
            feats = curv.augmented_features(layer.captured[0], layer.has_bias)
        return logits, feats.to(self.posterior(bnn).mean.dtype)

    def _moments(self, bnn: BayesianModel, x: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """MAP logits ``[B, C]`` and the functional variance ``(diag, rowsum, total)``."""
        posterior = self.posterior(bnn)
        layers = self._layers(bnn)
        tau = self.prior_precision(bnn)
        if self.last_layer:
            logits, feats = self._last_layer_features(bnn, x)
            return logits, posterior.functional_variance(feats, tau)
        params = curv.subnetwork_parameters(bnn.model, self._param_names(layers))
        pieces, logits_all = [], []
        for _, xc in curv.example_chunks(x, self._chunk(bnn, x, posterior.num_params)):
            jac, f = curv.per_example_jacobians(bnn.model, params, xc)
            logits_all.append(f.detach())
            pieces.append(posterior.functional_variance_from_jacobians(jac.detach(), tau))
        return torch.cat(logits_all), tuple(torch.cat([p[i] for p in pieces]) for i in range(3))

    @staticmethod
    def _mc_last_layer(posterior: Any, feats: torch.Tensor, tau: torch.Tensor, samples: int,
                       max_rows: int, seed: int | None) -> torch.Tensor:
        """``[S, B, C]``: S last-layer weight samples (fixed by ``seed``), f_s = W_s ã."""
        generator = torch.Generator().manual_seed(0 if seed is None else seed)
        z = torch.randn((samples, *posterior.mean.shape), generator=generator, dtype=torch.float64)
        z = z.to(posterior.mean)
        per_chunk = max(1, max_rows // max(feats.shape[0], 1))
        outs = [torch.einsum("bd,scd->sbc", feats, posterior.sample_weights(z[i:i + per_chunk], tau))
                for i in range(0, samples, per_chunk)]
        return torch.cat(outs)

    @staticmethod
    def _mc_subnetwork(posterior: post.SubnetworkDiag, jac: torch.Tensor, f: torch.Tensor,
                       tau: torch.Tensor, samples: int, seed: int | None) -> torch.Tensor:
        """``[S, B, C]`` GLM samples f_s = f* + J δ_s, δ_s ~ N(0, diag σ²) fixed by ``seed``."""
        generator = torch.Generator().manual_seed(0 if seed is None else seed)
        z = torch.randn((samples, posterior.num_params), generator=generator, dtype=torch.float64)
        delta = z.to(jac) * posterior.variance(tau).sqrt().to(jac)
        return f.unsqueeze(0) + torch.einsum("bcp,sp->sbc", jac, delta)

    def export_module(self, bnn: BayesianModel, *, samples_per_component: int, seed: int,
                      example_input: torch.Tensor) -> nn.Module:
        """``x → [M, B, C]`` of this predictive with τ-dependent posterior factors frozen
        into buffers; see :mod:`bayesify.methods.laplace.export`."""
        return export_laplace(self, bnn, samples_per_component=samples_per_component, seed=seed,
                              example_input=example_input,
                              deterministic=bnn.context.force_deterministic)

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _layers(bnn: BayesianModel) -> dict[str, LaplaceLayer]:
        return {n: m for n, m in bnn.bayesian_layers().items() if isinstance(m, LaplaceLayer)}

    @staticmethod
    def _param_names(layers: dict[str, LaplaceLayer]) -> list[str]:
        return [f"{lname}.base_layer.{p}" for lname, layer in layers.items()
                for p, _ in layer.base_layer.named_parameters()]

class _capturing:
    """Context manager: the layer keeps its input/output during the block, then forgets them."""

    def __init__(self, layer: LaplaceLayer) -> None:
        self.layer = layer

    def __enter__(self) -> LaplaceLayer:
        self.layer.capturing = True
        return self.layer

    def __exit__(self, *exc: object) -> None:
        self.layer.capturing = False
        self.layer.captured = None


def _first(layers: dict[str, LaplaceLayer]) -> LaplaceLayer:
    return next(iter(layers.values()))


def _num_batches(loader: Iterable) -> int:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return 0

