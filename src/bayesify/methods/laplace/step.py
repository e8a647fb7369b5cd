"""Laplace's curvature step: one gradient-free pass adds every batch's curvature (the softmax
GGN, or the feature curvature of ``curvature='features'``) to the layers'
buffers; ``end`` sums them over the ranks and chooses τ by the marginal likelihood
(``prior_method='marglik'``, or ``'auto'`` without a validation split). With validation
data the driver's knob search chooses τ instead (``LaplaceMethod.knobs``).
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bayesify.core.batch import call_model
from bayesify.core.checks import check_finite_inputs, check_finite_logits, check_labels
from bayesify.core.fitting import FitContext
from bayesify.core.names import in_base_layer
from bayesify.core.outputs import classifier_rows, logits_of, same_softmax
from bayesify.core.prediction import Prediction
from bayesify.errors import BayesifyError
from bayesify.kit import feature_layers as trunk
from bayesify.kit.steps import CurvatureStep, keeps_accuracy
from bayesify.methods.laplace import curvature as curv
from bayesify.methods.laplace import state
from bayesify.methods.laplace.config import LaplaceConfig
from bayesify.methods.laplace.layers import LaplaceLayer, refuse_parametrized

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)


#: training examples (per process) the accuracy guard of ``keep_accuracy`` predicts
GUARD_ROWS = 4096
#: τ × these factors are the guard's candidates (the evidence's τ first)
GUARD_FACTORS = tuple(10.0 ** (k / 2) for k in range(9))


def resolved_prior_method(config: LaplaceConfig, validating: bool) -> str:
    """``prior_method`` with ``'auto'`` resolved: ``'val_nll'`` given validation data."""
    if config.prior_method == "auto":
        return "val_nll" if validating else "marglik"
    return config.prior_method


def resolved_curvature(config: LaplaceConfig, validating: bool) -> str:
    """``curvature`` with ``'auto'`` resolved: ``'features'`` when the validation search
    chooses τ (it sees whether the broad feature-distance posterior holds on the data),
    else ``'ggn'`` (the marginal likelihood is the softmax model's)."""
    if config.curvature == "auto":
        return "features" if resolved_prior_method(config, validating) == "val_nll" else "ggn"
    return config.curvature


class LaplaceStep(CurvatureStep):
    """The curvature at the MAP (softmax GGN or the feature curvature), summed over the
    training data."""

    refusal = "Laplace is fitted by one gradient-free curvature pass over the data"

    def __init__(self, config: LaplaceConfig) -> None:
        self.config = config
        #: (features ã, labels) of the first GUARD_ROWS training examples (last layer)
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._curvature = "ggn"
        self._warned = False

    def ready(self, bnn: BayesianModel) -> bool:
        """The posterior exists once ``fit`` has built it."""
        return state.train_loss(bnn) is not None

    def begin(self, ctx: FitContext) -> None:
        if self.config.prior_method == "val_nll" and not ctx.validating:
            raise BayesifyError("prior_method='val_nll' needs fit(..., val_loader=...)")
        bnn = ctx.bnn
        self._curvature = resolved_curvature(self.config, ctx.validating)
        if not state.last_layer(bnn):
            self._subnetwork_curvature()
        for layer in state.layers(bnn).values():
            layer.reset_curvature()
        bnn.state.set("laplace_train_loss", 0.0)
        bnn.state.set("laplace_fitted", 0)
        state.forget_posterior(bnn)
        self._rows = []

    @torch.no_grad()
    def accumulate(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor) -> None:
        """Add one batch's curvature to the layers' buffers and its summed loss to the state.
        Last layer: one no-grad forward, features captured by the wrapper."""
        check_finite_inputs(inputs.args + tuple(inputs.kwargs.values()) if hasattr(inputs, "args")
                            else inputs, where="laplace fit")
        found = state.layers(bnn)
        head = state.first(found)
        dtype = head.n_data.dtype
        if state.last_layer(bnn):
            taps = self._taps(bnn, inputs)
            with state.capturing(head), taps.installed() if taps else nullcontext():
                logits = logits_of(call_model(bnn.model, inputs))
                feats = self._features(head, logits, check=True)
                if feats is not None:
                    check_finite_logits(logits, where="laplace fit")
                    _last_layer_batch(head, feats.to(dtype), logits.to(dtype).softmax(-1),
                                      self.config.logit_std if self._curvature == "features"
                                      else None)
                    if taps is not None:
                        self._trunk_batch(head, taps, logits)
            if feats is None:  # diag on a layer that is not the logits: Jacobian path
                refuse_parametrized(found)
                bnn.state.set("laplace_last_layer", 0)
                self._subnetwork_curvature()
                with torch.enable_grad():
                    logits = self._subnetwork_batch(bnn, found, inputs)
        else:
            with torch.enable_grad():
                logits = self._subnetwork_batch(bnn, found, inputs)
        check_finite_logits(logits, where="laplace fit")
        labels = check_labels(labels, logits.shape[-1], where="laplace fit")
        kept = sum(len(y) for _, y in self._rows)
        if state.last_layer(bnn) and feats is not None and kept < GUARD_ROWS:
            take = GUARD_ROWS - kept
            self._rows.append((feats[:take].float().cpu(), labels[:take].cpu()))
        loss = F.cross_entropy(logits.double(), labels, reduction="sum")
        total = bnn.state.get_buffer("laplace_train_loss")
        total.add_(loss.to(total.device, total.dtype))
        for layer in found.values():
            layer.n_data.add_(labels.shape[0])

    def _taps(self, bnn: BayesianModel, inputs: Any) -> trunk.Taps | None:
        """The feature layers' hooks, where their sums are fitted (the feature curvature;
        not for masked token sequences, whose pooled tokens would count the padding)."""
        names = list(self.config.feature_layers or ())
        if not names or self._curvature != "features":
            return None
        if trunk.masked_tokens(inputs):
            if not self._warned:
                self._warned = True
                logger.info("laplace: the inputs carry a mask (padded token sequences); the "
                            "feature layers %s stay off (pooling tokens would count the "
                            "padding)", names)
            return None
        return trunk.Taps(bnn.model, names)

    def _trunk_batch(self, head: LaplaceLayer, taps: trunk.Taps, logits: torch.Tensor) -> None:
        psi, missing = taps.features(logits.shape[0], torch.float64, logits.device)
        if missing and not self._warned:
            self._warned = True
            logger.warning(
                "laplace: feature layers %s gave no [batch, features] output in this forward; "
                "their part of the variance is 0 (name others with feature_layers=[...], or "
                "pass feature_layers=None)", missing)
        check_finite_logits(psi, where="laplace fit (feature layers)")
        trunk.accumulate(head, psi, head.captured[0])

    def _subnetwork_curvature(self) -> None:
        """A subnetwork posterior's curvature is the GGN ('auto' resolves to it)."""
        if self.config.curvature == "features":
            raise BayesifyError(
                "curvature='features' is the curvature of a last-layer posterior (a Gaussian "
                "likelihood on the logits of the wrapped classifier); a subnetwork posterior "
                "uses curvature='ggn' (or 'auto')")
        self._curvature = "ggn"

    def statistics(self, bnn: BayesianModel) -> list[torch.Tensor]:
        """Curvature buffers and N of every layer (not τ) and the summed training loss."""
        out = [buffer for layer in state.layers(bnn).values()
               for name, buffer in layer.named_buffers()
               if not in_base_layer(name) and name != "prior_precision"]
        return out + [bnn.state.get_buffer("laplace_train_loss")]

    def finish(self, ctx: FitContext) -> dict[str, Any]:
        """Mark the posterior fitted; τ by the marginal likelihood unless the driver's
        validation search chooses it (it records τ and the evidence then)."""
        bnn, cfg = ctx.bnn, self.config
        bnn.state.set("laplace_fitted", 1)
        state.forget_posterior(bnn)
        found = state.layers(bnn)
        method = resolved_prior_method(cfg, ctx.validating)
        record: dict[str, Any] = {"n_data": float(state.first(found).n_data),
                                  "curvature": self._curvature,
                                  "train_loss": float(bnn.state.get_buffer("laplace_train_loss")),
                                  "prior_method": method}
        if trunk.fitted(state.first(found)):
            record["feature_layers"] = list(cfg.feature_layers)
        if method == "marglik":
            count = len(found) if cfg.prior_per_layer else 1
            log_tau = torch.full((count,), math.log(cfg.prior_precision), dtype=torch.float64,
                                 device=bnn.device, requires_grad=True)
            opt = torch.optim.Adam([log_tau], lr=cfg.marglik_lr)
            with torch.enable_grad():
                for _ in range(cfg.marglik_steps):
                    opt.zero_grad()
                    (-state.log_marginal_likelihood(bnn, cfg, log_tau.exp())).backward()
                    opt.step()
            state.set_prior_precision(bnn, log_tau.detach().exp())
            if cfg.prior_method == "auto" and cfg.keep_accuracy is not None:
                record.update(self._keep_accuracy(ctx))
        if method != "val_nll":
            record.update(state.evidence_record(bnn, cfg))
        return record

    def _keep_accuracy(self, ctx: FitContext) -> dict[str, Any]:
        """Raise τ (×√10 steps, :data:`GUARD_FACTORS`) until the predictive's accuracy on the
        kept training examples is within ``keep_accuracy`` of the MAP's; every rank counts
        its own examples and all choose from the summed counts. Last layer, probit / bridge
        link only (the MC link's argmax is a sample's)."""
        bnn, cfg = ctx.bnn, self.config
        if not state.last_layer(bnn) or cfg.link == "mc":
            return {}
        posterior = state.posterior(bnn, cfg)
        tau = state.prior_precision(bnn, cfg)
        device, dtype = posterior.mean.device, posterior.mean.dtype
        correct = torch.zeros(len(GUARD_FACTORS) + 2, dtype=torch.float64, device=device)
        for feats, labels in self._rows:
            feats, labels = feats.to(device, dtype), labels.to(device)
            f = feats @ posterior.mean.T
            correct[0] += (f.argmax(-1) == labels).sum()
            for k, factor in enumerate(GUARD_FACTORS):
                diag, rowsum, total = posterior.functional_variance(feats, tau * factor)
                probs = Prediction(mean=f.float(), variance=diag.float(), link=cfg.link,
                                   rowsum=rowsum.float(), total=total.float()).probs
                correct[k + 1] += (probs.argmax(-1) == labels).sum()
            correct[-1] += len(labels)
        self._rows = []
        guard = keeps_accuracy(ctx, correct, cfg.keep_accuracy)
        if guard is None:
            return {}
        chosen, accuracy, n = guard
        chosen = len(GUARD_FACTORS) - 1 if chosen is None else chosen
        if chosen > 0:
            state.set_prior_precision(bnn, tau * GUARD_FACTORS[chosen])
            state.forget_posterior(bnn)
            logger.info(
                "laplace: the evidence's prior precision %.3g lost %.1f accuracy points against "
                "the MAP on %d training examples; τ raised ×%.3g to %.3g (keep_accuracy=%g; "
                "pass a val_loader to choose τ on validation data)", float(tau.reshape(-1)[0]),
                100 * (accuracy[0] - accuracy[1]), n, GUARD_FACTORS[chosen],
                float((tau * GUARD_FACTORS[chosen]).reshape(-1)[0]), cfg.keep_accuracy)
        return {"marglik_prior_precision": float(tau.reshape(-1)[0]),
                "guard_train_accuracy_map": accuracy[0],
                "guard_train_accuracy": accuracy[chosen + 1]}

    def _features(self, layer: LaplaceLayer, logits: torch.Tensor, *,
                  check: bool) -> torch.Tensor | None:
        """ã ``[B, D']`` from the captured input, after checking the layer makes the logits."""
        a, out = classifier_rows(*layer.captured, logits)
        if check and (a.dim() != 2 or not same_softmax(out, logits)):
            if self.config.structure != "diag":
                advice = ("name the classifier in targets=[...] or use structure='diag'"
                          if out.shape[-1] == logits.shape[-1] else
                          "its output is not the logits (a one-logit classifier that output_fn "
                          "makes two-class, say): use structure='diag' (or 'auto')")
                raise BayesifyError(
                    "last-layer Laplace needs the wrapped Linear to produce the model's logits "
                    f"from [B, D] features (saw input {tuple(a.shape)}, output {tuple(out.shape)}, "
                    f"logits {tuple(logits.shape)}); {advice}"
                )
            return None
        return curv.augmented_features(a, layer.has_bias)

    def _subnetwork_batch(self, bnn: BayesianModel, found: dict[str, LaplaceLayer],
                          x: torch.Tensor) -> torch.Tensor:
        """Accumulate the diagonal GGN of a batch; returns its logits ``[B, C]``."""
        cfg = self.config
        params = curv.subnetwork_parameters(bnn.model, state.param_names(found))
        h = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float64, device=x.device)
        outs = []
        if cfg.diag_ggn == "mc":
            with torch.no_grad():
                logits = logits_of(bnn.model(x))
            h += curv.fisher_diag_sampled(bnn.model, params, x, logits.softmax(-1),
                                          samples=cfg.ggn_samples).double()
            outs.append(logits)
        else:
            for _, xc in curv.example_chunks(x, state.chunk(bnn, cfg, x, h.numel())):
                jac, f = curv.per_example_jacobians(bnn.model, params, xc)
                h += curv.ggn_diag_from_jacobians(jac.double(), f.double().softmax(-1))
                outs.append(f.detach())
        offset = 0
        for layer in found.values():
            size = layer.num_params()
            layer.ggn_diag.add_(h[offset:offset + size].to(layer.ggn_diag.dtype))
            offset += size
        return torch.cat(outs)


def _last_layer_batch(layer: LaplaceLayer, feats: torch.Tensor, probs: torch.Tensor,
                      logit_std: float | None = None) -> None:
    """Add a batch's curvature to ``layer``'s buffers: the softmax GGN, or with ``logit_std``
    the feature curvature ``Σ I ⊗ ã ãᵀ / logit_std²``."""
    if logit_std is not None:
        parts = curv.features_curvature(feats, layer.base_layer.out_features, layer.structure,
                                        layer.has_bias, 1.0 / logit_std**2)
    elif layer.structure == "kron":
        parts = curv.kron_factors(feats, probs)
    elif layer.structure == "diag":
        parts = (curv.last_layer_diag(feats, probs, layer.has_bias),)
    else:
        parts = (curv.last_layer_full(feats, probs),)
    buffers = {"kron": ("kron_input", "kron_output"), "diag": ("ggn_diag",),
               "full": ("ggn_full",)}[layer.structure]
    for name, part in zip(buffers, parts, strict=True):
        getattr(layer, name).add_(part)
