"""Laplace family: curvature in one data pass, prior precision by evidence or val NLL,
linearised (GLM) predictive with probit / bridge / MC link.

Two modes, chosen from the targets:

* **last layer** (one Linear target whose output is the model's logits): curvature
  from the features captured by the wrapper's forward (``kron``, ``diag``, ``full``) —
  the softmax GGN, or (``curvature='features'``, the default when a ``val_loader``'s
  search chooses τ) that of a Gaussian likelihood on the logits, ``I ⊗ Σ ã ãᵀ / σ²``,
  whose GLM variance is a Mahalanobis distance of the features from the training
  features (every example weighs alike; the GGN weighs each by ``p(1 − p)``), with the
  feature layers' distance at earlier depths added (``feature_layers``,
  :mod:`bayesify.kit.feature_layers`);
* **subnetwork** (any other targets, ``structure='diag'``): per-example Jacobians with
  ``torch.func`` (exact GGN diagonal, or a sampled Fisher).

Prediction returns ``[M, B, C]`` "member logits": for probit/bridge M = 1 and the
logits *are* the log predictive probabilities; for MC, M samples of the GLM.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from bayesify.core.batch import call_model
from bayesify.core.context import SamplingContext
from bayesify.core.fitting import Knob, Step
from bayesify.core.locks import model_lock
from bayesify.core.method import Method, wrap_targets
from bayesify.core.outputs import classifier_rows, logits_of
from bayesify.core.prediction import Prediction
from bayesify.core.selection import log_grid, prior_is_negligible
from bayesify.core.walker import classifier_group
from bayesify.errors import BayesifyError
from bayesify.kit import feature_layers as trunk
from bayesify.methods.laplace import curvature as curv
from bayesify.methods.laplace import posterior as post
from bayesify.methods.laplace import state
from bayesify.methods.laplace.config import AUTO_FULL_PARAMS, LaplaceConfig, auto_structure
from bayesify.methods.laplace.export import export_laplace
from bayesify.methods.laplace.layers import LaplaceLayer, refuse_parametrized
from bayesify.methods.laplace.step import LaplaceStep

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)


def joint_heads(model: nn.Module, targets: list[str]) -> bool:
    """Whether ``targets`` are a distilled model's heads whose mean is the logits
    (:func:`~bayesify.core.walker.classifier_group`): Linears of one output width, which
    the last-layer posterior covers as one joint classifier (:meth:`LaplaceLayer.join`)."""
    if len(targets) < 2 or list(targets) != classifier_group(model):
        return False
    heads = [model.get_submodule(t) for t in targets]
    return all(isinstance(h, nn.Linear) for h in heads) and len(
        {h.out_features for h in heads}) == 1


class _JointShape:
    """What :func:`auto_structure` reads of a classifier, for the joint one of ``targets``."""

    def __init__(self, modules: dict[str, nn.Module], targets: list[str]) -> None:
        heads = [modules[t] for t in targets]
        self.out_features = heads[0].out_features
        self._count = self.out_features * (sum(h.in_features for h in heads) + 1)

    def parameters(self) -> list[torch.Tensor]:
        return [torch.empty(self._count, device="meta")]


class LaplaceMethod(Method):
    """Laplace approximation around the pretrained (MAP) weights; post-hoc."""

    laplace_heads_unsupported: ClassVar[str] = (
        "it is a last-layer Laplace already (targets='last_layer')")

    name = "laplace"
    config_cls = LaplaceConfig
    wrappers: ClassVar = {nn.Linear: LaplaceLayer, nn.Conv1d: LaplaceLayer,
                          nn.Conv2d: LaplaceLayer, nn.Conv3d: LaplaceLayer}
    #: the validation search may sharpen the predictive (T < 1): the GLM's epistemic variance
    #: is larger off the data, so a sharpened broad posterior stays broad there
    #: (bayesify.train.tuning.sharpening_allowed)
    sharpens_predictive: ClassVar[bool] = True
    #: a distilled model's logits are the mean of two heads: the posterior covers both (the
    #: last-layer one of their joint classifier, :func:`joint_heads`; with structure='diag'
    #: the subnetwork one; one wrapped head alone does not make the logits). Read
    #: by the walker's ``targets='last_layer'`` (:func:`bayesify.core.walker.classifier_group`;
    #: a family class attribute like ``sharpens_predictive``, not a ``Method`` member)
    every_classifier: ClassVar[bool] = True

    # -- structure and training --------------------------------------------------------
    def build(self, model: nn.Module, targets: list[str],
              context: SamplingContext) -> dict[str, nn.Module]:
        """Resolves ``structure='auto'`` (the config then holds what was chosen, so a saved
        posterior names it), refuses kron/full on anything but one Linear target, then wraps
        the targets."""
        modules = dict(model.named_modules())
        single_linear = len(targets) == 1 and isinstance(modules[targets[0]], nn.Linear)
        joint = joint_heads(model, targets)
        if self.config.structure == "auto":
            classifier = (modules[targets[0]] if single_linear
                          else _JointShape(modules, targets) if joint else None)
            chosen = auto_structure(classifier, self.config.max_full_params)
            logger.info("laplace: structure='auto' → %r (%s)", chosen,
                        "a subnetwork" if classifier is None else
                        f"{sum(p.numel() for p in classifier.parameters())} last-layer "
                        f"parameters{' over the heads ' + str(targets) if joint else ''}; "
                        f"full up to {AUTO_FULL_PARAMS}")
            self.config = dataclasses.replace(self.config, structure=chosen)
        last_layer = single_linear or (joint and self.config.structure in ("kron", "full"))
        if self.config.structure in ("kron", "full") and not last_layer:
            raise BayesifyError(
                f"structure={self.config.structure!r} needs exactly one Linear target (the "
                f"classifier, targets='last_layer'; or a distilled model's heads); got "
                f"{list(targets)[:5]}. Use structure='diag' for a subnetwork"
            )
        if not last_layer:
            refuse_parametrized({t: modules[t] for t in targets})
        names = self._feature_layers(model, targets[0] if last_layer else None)
        widths = trunk.check_layers(model, names)
        wrapped = wrap_targets(self, model, targets, context)
        if last_layer and joint:
            wrapped[targets[0]].join([wrapped[t] for t in targets[1:]])
        if names:
            trunk.register_buffers(wrapped[targets[0]], sum(widths))
        return wrapped

    def _feature_layers(self, model: nn.Module, classifier: str | None) -> list[str]:
        """``feature_layers`` resolved (the config then holds the names, so a saved posterior
        names them): none for a subnetwork, the MC link or the softmax GGN (the feature
        layers' posterior is the feature curvature's)."""
        cfg = self.config
        names = cfg.feature_layers
        if names is None or classifier is None or cfg.link == "mc" or cfg.curvature == "ggn":
            if isinstance(names, (list, tuple)) and names:
                raise BayesifyError(
                    f"method 'laplace': feature_layers={list(names)} needs a last-layer "
                    "posterior (targets='last_layer') with curvature 'features' or 'auto' and "
                    f"the probit or bridge link (got link={cfg.link!r}, curvature="
                    f"{cfg.curvature!r}); pass feature_layers=None")
            names = []
        elif names == "auto":
            names = trunk.auto_layers(model, classifier)
            logger.info("laplace: feature_layers='auto' → %s", names or "none (no "
                        "normalisation layers outside the classifier)")
        self.config = dataclasses.replace(self.config, feature_layers=tuple(names))
        return list(names)

    def prepare(self, bnn: BayesianModel) -> None:
        state.register(bnn)

    def step(self) -> Step:
        return LaplaceStep(self.config)

    def knobs(self, bnn: BayesianModel) -> list[Knob]:
        """τ on ``val_grid`` by validation NLL (``prior_method`` 'val_nll', or 'auto' given
        validation data) once the curvature is fitted; the broadest posterior is the
        smallest τ."""
        cfg: LaplaceConfig = self.config
        if cfg.prior_method not in ("auto", "val_nll") or state.train_loss(bnn) is None:
            return []
        grid = tuple(log_grid(cfg.val_grid))
        one_pass = state.last_layer(bnn) and cfg.link != "mc"
        return [Knob(name="prior_precision", grid=grid,
                     meaning="prior precision τ of the Laplace posterior; smaller is broader",
                     set=lambda tau: state.set_prior_precision(bnn, tau), prefer="smallest",
                     rule=cfg.val_rule, settle=lambda: state.evidence_record(bnn, cfg),
                     broad_limit=lambda: prior_is_negligible(
                         post.curvature_eigenvalues(self.posterior(bnn)), min(grid)),
                     grid_log_probs=(lambda x: self._grid_log_probs(bnn, x, grid))
                     if one_pass else None)]

    @torch.no_grad()
    def _grid_log_probs(self, bnn: BayesianModel, x: Any,
                        taus: tuple[float, ...]) -> list[torch.Tensor]:
        """``[B, C]`` log p̄ (T = 1) of the last-layer GLM predictive at every τ from one
        forward (the features do not depend on τ): what setting each τ and predicting gives."""
        with model_lock(bnn):
            logits, feats, psi = self._last_layer_features(bnn, x)
        posterior = self.posterior(bnn)
        values = [torch.as_tensor(tau, dtype=feats.dtype, device=feats.device) for tau in taus]
        many = getattr(posterior, "functional_variances", None)  # one projection for all τ
        variances = (many(feats, values) if many is not None
                     else [posterior.functional_variance(feats, tau) for tau in values])
        view = state.trunk_posterior(bnn, self.config)
        if view is not None:
            projected = view.projections(psi)
            variances = [trunk.add_variance(fvar, projected @ (1.0 / (view.eig + tau)))
                         for fvar, tau in zip(variances, values, strict=True)]
        return [Prediction(mean=logits.float(), variance=diag.float(), link=self.config.link,
                           rowsum=rowsum.float(), total=total.float()).raw_log_probs
                for diag, rowsum, total in variances]

    # -- the fitted posterior (views over bnn.state and the layers' buffers) ---------------
    def posterior(self, bnn: BayesianModel) -> Any:
        """The posterior view over the layers' curvature buffers (cached until the next fit)."""
        return state.posterior(bnn, self.config)

    def prior_precision(self, bnn: BayesianModel) -> torch.Tensor:
        """τ: ``[1]`` (scalar) or ``[L]`` (one per wrapped layer)."""
        return state.prior_precision(bnn, self.config)

    def set_prior_precision(self, bnn: BayesianModel, tau: torch.Tensor | float) -> None:
        state.set_prior_precision(bnn, tau)

    def log_marginal_likelihood(self, bnn: BayesianModel,
                                tau: torch.Tensor | None = None) -> torch.Tensor:
        """Laplace evidence at τ (default: the current prior precision); differentiable in τ."""
        return state.log_marginal_likelihood(bnn, self.config, tau)

    # -- prediction ------------------------------------------------------------------------
    def predictive(self, bnn: BayesianModel, x: Any, *, samples_per_component: int,
                   max_rows: int, seed: int | None = None, deterministic: bool = False) -> Any:
        """Linearised (GLM) predictive: a Gaussian over the logits ``(f*, diag Σ_f)``
        with the probit or bridge link applied last; MC samples for ``link='mc'``."""
        if deterministic or state.train_loss(bnn) is None or self.config.link == "mc":
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
        if deterministic or state.train_loss(bnn) is None:
            return logits_of(call_model(bnn.model, x)).unsqueeze(0)
        if self.config.link != "mc":
            return self.predictive(bnn, x, samples_per_component=samples_per_component,
                                   max_rows=max_rows, seed=seed).member_logits
        posterior = self.posterior(bnn)
        layers = state.layers(bnn)
        tau = self.prior_precision(bnn)
        if state.last_layer(bnn):
            _, feats, _ = self._last_layer_features(bnn, x)
            return _mc_last_layer(posterior, feats, tau, samples_per_component, max_rows, seed)
        params = curv.subnetwork_parameters(bnn.model, state.param_names(layers))
        pieces = []
        for _, xc in curv.example_chunks(x, state.chunk(bnn, self.config, x, posterior.num_params)):
            jac, f = curv.per_example_jacobians(bnn.model, params, xc)
            pieces.append(_mc_subnetwork(posterior, jac.detach(), f.detach(), tau,
                                         samples_per_component, seed))
        return torch.cat(pieces, dim=1)

    def _last_layer_features(self, bnn: BayesianModel, x: Any) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """MAP logits ``[B, C]``, the augmented features ã ``[B, D']`` of the classifier and,
        where their posterior was fitted, the feature layers' pooled outputs ``ψ [B, Σd]``."""
        layer = state.first(state.layers(bnn))
        dtype = self.posterior(bnn).mean.dtype
        view = state.trunk_posterior(bnn, self.config)
        taps = trunk.Taps(bnn.model, list(self.config.feature_layers)) if view else None
        with state.capturing(layer), taps.installed() if taps else nullcontext():
            model_logits = logits_of(call_model(bnn.model, x))
            # the classifier's output is the GLM's mean: the model's logits, or the same up
            # to a constant per row (a log_softmax after it; fit checked which), at the
            # position that makes them where the classifier runs at every position
            a, logits = classifier_rows(*layer.captured, model_logits)
            feats = curv.augmented_features(a, layer.has_bias)
            psi = taps.features(logits.shape[0], torch.float64, logits.device)[0] if taps else None
        return logits, feats.to(dtype), psi

    def _moments(self, bnn: BayesianModel, x: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """MAP logits ``[B, C]`` and the functional variance ``(diag, rowsum, total)``."""
        posterior = self.posterior(bnn)
        layers = state.layers(bnn)
        tau = self.prior_precision(bnn)
        if state.last_layer(bnn):
            logits, feats, psi = self._last_layer_features(bnn, x)
            fvar = posterior.functional_variance(feats, tau)
            view = state.trunk_posterior(bnn, self.config)
            if view is not None:
                fvar = trunk.add_variance(fvar, view.variance(psi, tau.reshape(-1)[0]))
            return logits, fvar
        params = curv.subnetwork_parameters(bnn.model, state.param_names(layers))
        pieces, logits_all = [], []
        for _, xc in curv.example_chunks(x, state.chunk(bnn, self.config, x, posterior.num_params)):
            jac, f = curv.per_example_jacobians(bnn.model, params, xc)
            logits_all.append(f.detach())
            pieces.append(posterior.functional_variance_from_jacobians(jac.detach(), tau))
        return torch.cat(logits_all), tuple(torch.cat([p[i] for p in pieces]) for i in range(3))

    def export_module(self, bnn: BayesianModel, *, samples_per_component: int, seed: int,
                      example_input: Any) -> nn.Module:
        """``x → [M, B, C]`` of this predictive with τ-dependent posterior factors frozen
        into buffers; see :mod:`bayesify.methods.laplace.export`."""
        return export_laplace(bnn, self.config, samples_per_component=samples_per_component,
                              seed=seed, deterministic=bnn.context.force_deterministic)


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


def _mc_subnetwork(posterior: post.SubnetworkDiag, jac: torch.Tensor, f: torch.Tensor,
                   tau: torch.Tensor, samples: int, seed: int | None) -> torch.Tensor:
    """``[S, B, C]`` GLM samples f_s = f* + J δ_s, δ_s ~ N(0, diag σ²) fixed by ``seed``."""
    generator = torch.Generator().manual_seed(0 if seed is None else seed)
    z = torch.randn((samples, posterior.num_params), generator=generator, dtype=torch.float64)
    delta = z.to(jac) * posterior.variance(tau).sqrt().to(jac)
    return f.unsqueeze(0) + torch.einsum("bcp,sp->sbc", jac, delta)

