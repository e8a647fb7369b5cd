"""Export of the Laplace predictive: the linearised (GLM) predictive as a plain module.

``export_laplace(bnn, config, ...)`` returns ``x [B, ...] → [M, B, C]`` computing exactly what
``LaplaceMethod.member_logits`` computes, with everything that depends only on the
posterior (and τ) precomputed into buffers:

* last layer, probit / bridge: the Gaussian over the logits ``[3, B, C]`` (mean, diag Σ_f,
  Σ_f 1)::

      ã = [a(x), 1],  f* = W* ã,  Σ_f = J Σ Jᵀ  →  [diag Σ_f, Σ_f 1, 1ᵀ Σ_f 1]
      kron: Q_A, Q_G, 1/(λ_G λ_Aᵀ/N + τ)       diag: 1/(h + τ)       full: Σ blocks

  the exported predictor applies ``log softmax(f*/sqrt(1 + π/8 diag Σ_f))`` (probit) or the
  Laplace bridge, then the predictive-level temperature ``softmax(log p̄ / T)``;
* last layer, mc: the S frozen weight samples ``W_s [S, C, D']``, ``f_s = W_s ã``.

The subnetwork (diagonal) posterior is refused: its predictive needs per-example
Jacobians (``vmap(jacrev)``), which torch.export cannot trace.

The epistemic part of probit / bridge is the link's entropy minus the expected entropy of
fixed draws of the Gaussian, as in process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.outputs import classifier_rows, logits_of
from bayesify.core.walker import replace_modules
from bayesify.errors import BayesifyError
from bayesify.kit import feature_layers as trunk
from bayesify.kit.stacked import StackedModels
from bayesify.methods.laplace import posterior as post
from bayesify.methods.laplace import state
from bayesify.methods.laplace.config import LaplaceConfig
from bayesify.methods.laplace.curvature import augmented_features

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


class FeatureTap(nn.Module):
    """Stands in for the Laplace classifier: ``a [B, D] → W a + b``, keeping ``a``.

    The features are read back by :class:`LastLayerLaplace` right after the forward
    (torch.export traces Python, so the attribute hand-over is not part of the graph).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.features: torch.Tensor | None = None
        self.output: torch.Tensor | None = None

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        self.features = a
        self.output = self.linear(a)
        return self.output


class PooledTap(nn.Module):
    """Stands in for a feature layer (:mod:`bayesify.kit.feature_layers`): its output,
    kept for :class:`LastLayerLaplace` to pool (as :class:`FeatureTap` keeps ``a``)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.output: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.output = self.norm(*args, **kwargs)
        return self.output


def _unwrapped_with_tap(bnn: BayesianModel, names: list[str], feature_layers: list[str],
                        ) -> tuple[nn.Module, list[FeatureTap], list[PooledTap]]:
    """The unwrapped network with every classifier in ``names`` (one, or a distilled model's
    heads) replaced by a :class:`FeatureTap` and every feature layer by a :class:`PooledTap`."""
    net = bnn.unwrap().eval()
    taps = [FeatureTap(net.get_submodule(name) if name else net) for name in names]
    pools = [PooledTap(net.get_submodule(n)) for n in feature_layers]
    if names == [""]:
        return taps[0], taps, pools
    replace_modules(net, {**dict(zip(names, taps, strict=True)),
                          **dict(zip(feature_layers, pools, strict=True))})
    return net, taps, pools


class LastLayerLaplace(nn.Module):
    """``x → [M, B, C]`` of the last-layer Laplace predictive (see the module docstring)."""

    def __init__(self, model: nn.Module, taps: list[FeatureTap], *, has_bias: bool, link: str,
                 structure: str, dtype: torch.dtype, tensors: dict[str, torch.Tensor],
                 pools: list[PooledTap] | None = None) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "taps", list(taps))  # already submodules of model
        object.__setattr__(self, "pools", list(pools or []))  # so are these
        self.has_bias, self.link, self.structure, self.dtype = has_bias, link, structure, dtype
        for key, value in tensors.items():
            self.register_buffer(key, value.detach().clone())

    def functional_variance(self, feats: torch.Tensor) -> post.FunctionalVariance:
        """``(diag Σ_f [B, C], Σ_f 1 [B, C], 1ᵀ Σ_f 1 [B])`` with the same arithmetic as
        :mod:`bayesify.methods.laplace.posterior`."""
        if self.structure == "kron":
            s = (feats @ self.q_a).square() @ self.inv_eig.T  # [B, C]
            diag = s @ self.q_g_sq.T
            rowsum = (s * self.q_g_sum) @ self.q_g.T
            return diag, rowsum, (s * self.q_g_sum.square()).sum(-1)
        if self.structure == "diag":
            diag = feats.square() @ self.inv_h.T
            return diag, diag, diag.sum(-1)
        return post.full_blocks_variance(feats, self.cov_blocks, self.cov_rows)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        model_logits = logits_of(self.model(*args, **kwargs))
        # the classifier's output is the mean (the model's logits up to a constant per row),
        # at the position that makes them where it runs at every position (a decoder)
        got = []
        for tap in self.taps:
            got.append((tap.features, tap.output))
            tap.features, tap.output = None, None
        if len(got) == 1:
            a, out = got[0]
        else:  # a distilled model's heads: the joint classifier's features and mean
            k = len(got)
            a = torch.cat([f / k for f, _ in got], dim=-1)
            out = torch.stack([o for _, o in got]).mean(0)
        a, logits = classifier_rows(a, out, model_logits)
        feats = augmented_features(a, self.has_bias).to(self.dtype)
        if self.link == "mc":
            return torch.einsum("bd,scd->sbc", feats, self.weight_samples)
        diag, rowsum, _ = self.functional_variance(feats)
        if self.pools:  # the feature layers' v(x), the same for every class
            psi = torch.cat([self._pooled(p, a) for p in self.pools], dim=1)
            v = trunk.distance(psi, self).unsqueeze(-1).to(diag)
            diag, rowsum = diag + v, rowsum + v
        # the Gaussian over the logits: [3, B, C] = (mean, diag Σ_f, Σ_f 1); the link and
        # the uncertainty decomposition are applied by the exported predictor
        return torch.stack([logits.float(), diag.float(), rowsum.float()])

    def _pooled(self, pool: PooledTap, a: torch.Tensor) -> torch.Tensor:
        """As in process: the pooled ``[B, d]``, zeros where the layer gave no such output."""
        out, pool.output = pool.output, None
        got = trunk.pooled(pool.norm, out, a.shape[0])
        if got is None:
            return torch.zeros(a.shape[0], trunk.width(pool.norm), dtype=self.trunk_mu.dtype,
                               device=a.device)
        return got.to(self.trunk_mu.dtype)

    @property
    def gaussian_link(self) -> str | None:
        """The link of a Gaussian predictive (None for MC samples)."""
        return None if self.link == "mc" else self.link


def _last_layer_tensors(posterior: object, structure: str, link: str, tau: torch.Tensor, *,
                        samples: int, seed: int | None) -> dict[str, torch.Tensor]:
    """What the forward needs of the posterior at τ, precomputed once (no eigh / cholesky
    in the graph)."""
    with torch.no_grad():
        if link == "mc":  # the predictor's S draws: same generator, same order as in process
            generator = torch.Generator().manual_seed(0 if seed is None else seed)
            z = torch.randn((samples, *posterior.mean.shape), generator=generator, dtype=torch.float64)
            return {"weight_samples": posterior.sample_weights(z.to(posterior.mean), tau)}
        if structure == "kron":
            return {"q_a": posterior.q_a, "inv_eig": 1.0 / (posterior.eig + tau),
                    "q_g": posterior.q_g, "q_g_sq": posterior.q_g.square(),
                    "q_g_sum": posterior.q_g.sum(0)}
        if structure == "diag":
            return {"inv_h": 1.0 / (posterior.h + tau)}
        blocks, rows = posterior.blocks(tau)
        return {"cov_blocks": blocks, "cov_rows": rows}


def export_laplace(bnn: BayesianModel, config: LaplaceConfig, *, samples_per_component: int,
                   seed: int, deterministic: bool) -> nn.Module:
    """The plain ``x → [M, B, C]`` module of the fitted predictive (see module docstring)."""
    if deterministic or state.train_loss(bnn) is None:  # in process: the MAP network alone
        return StackedModels([bnn.unwrap()])
    if state.last_layer(bnn):
        found = state.layers(bnn)
        layer = state.first(found)
        names = list(found) if layer.joint else [next(iter(found))]
        posterior = state.posterior(bnn, config)
        tau = state.prior_precision(bnn, config).detach()
        view = state.trunk_posterior(bnn, config)
        feature_layers = list(config.feature_layers) if view is not None else []
        model, taps, pools = _unwrapped_with_tap(bnn, names, feature_layers)
        tensors = _last_layer_tensors(posterior, layer.structure, config.link, tau,
                                      samples=samples_per_component, seed=seed)
        if view is not None:
            tensors.update(view.export_tensors(tau))
        return LastLayerLaplace(model, taps, has_bias=layer.has_bias, link=config.link,
                                structure=layer.structure, dtype=posterior.mean.dtype,
                                tensors=tensors, pools=pools).eval()
    raise BayesifyError(
        "method 'laplace' with a subnetwork (diagonal) posterior cannot be exported: its "
        "predictive needs per-example Jacobians (torch.func vmap/jacrev), which "
        "torch.export cannot trace; export a last-layer Laplace (targets='last_layer' on "
        "a model with one classifier or a distilled model's heads, structure kron/full) "
        "instead. (A one-logit binary classifier made two-class by output_fn gets the "
        "subnetwork posterior by default: export another family there, e.g. 'ensemble'.)"
    )
