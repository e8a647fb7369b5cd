"""The fitted Laplace posterior of one model: views over ``bnn.state`` and layer buffers.

Everything here takes the model: what is fitted lives in ``bnn.state``
(``laplace_last_layer``, ``laplace_fitted``, ``laplace_train_loss``) and in the
:class:`LaplaceLayer` buffers (curvature, τ, N); the posterior view over them
(eigendecompositions, Cholesky factors) is cached in ``bnn.runtime`` until the
curvature changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.names import wrapped_name
from bayesify.core.outputs import logits_of
from bayesify.core.state import derived
from bayesify.errors import BayesifyError
from bayesify.kit import feature_layers as trunk
from bayesify.methods.laplace import posterior as post
from bayesify.methods.laplace.config import LaplaceConfig
from bayesify.methods.laplace.layers import LaplaceLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

LAST_LAYER_POSTERIORS = {"kron": post.LastLayerKron, "diag": post.LastLayerDiag,
                         "full": post.LastLayerFull}
_POSTERIOR = derived("laplace_posterior")
_TRUNK = derived("laplace_trunk")
_CLASSES = "laplace_classes"


def layers(bnn: BayesianModel) -> dict[str, LaplaceLayer]:
    """The Laplace layers by base-model name."""
    return {n: m for n, m in bnn.bayesian_layers().items() if isinstance(m, LaplaceLayer)}


def first(found: dict[str, LaplaceLayer]) -> LaplaceLayer:
    return next(iter(found.values()))


def register(bnn: BayesianModel) -> None:
    """The family state entries (called from ``prepare``)."""
    found = layers(bnn)
    single_linear = len(found) == 1 and isinstance(first(found).base_layer, nn.Linear)
    joint = first(found).joint and first(found).structure in ("kron", "full")  # distilled heads
    bnn.state.add("laplace_last_layer", torch.tensor(int(single_linear or joint)))
    bnn.state.add("laplace_fitted", torch.tensor(0))
    bnn.state.add("laplace_train_loss", torch.zeros((), dtype=torch.float64))


def last_layer(bnn: BayesianModel) -> bool:
    """Whether the posterior is the last-layer one (else the subnetwork diagonal)."""
    return bool(bnn.state.value("laplace_last_layer"))


def train_loss(bnn: BayesianModel) -> torch.Tensor | None:
    """Σ cross-entropy at θ* over the training data (None before ``fit``)."""
    if not bnn.state.value("laplace_fitted"):
        return None
    return bnn.state.get_buffer("laplace_train_loss")


def forget_posterior(bnn: BayesianModel) -> None:
    """Drop the cached posterior views (the curvature changed)."""
    bnn.runtime.pop(_POSTERIOR, None)
    bnn.runtime.pop(_TRUNK, None)


def trunk_posterior(bnn: BayesianModel, config: LaplaceConfig) -> trunk.TrunkPosterior | None:
    """The feature layers' posterior (:mod:`bayesify.kit.feature_layers`) when it was
    fitted, else None (cached like the posterior view)."""
    if _TRUNK in bnn.runtime:
        return bnn.runtime[_TRUNK]
    view = None
    head = first(layers(bnn))
    if last_layer(bnn) and config.feature_layers and trunk.fitted(head):
        widths = trunk.check_layers(bnn.model, list(config.feature_layers))
        view = trunk.TrunkPosterior(trunk.sums_of(head), widths, config.logit_std)
    bnn.runtime[_TRUNK] = view
    return view


def posterior(bnn: BayesianModel, config: LaplaceConfig) -> Any:
    """The posterior view over the layers' curvature buffers (cached until the next fit)."""
    view = bnn.runtime.get(_POSTERIOR)
    if view is None:
        found = layers(bnn)
        if last_layer(bnn):
            view = LAST_LAYER_POSTERIORS[config.structure](first(found))
        else:
            view = post.SubnetworkDiag(list(found.values()))
        bnn.runtime[_POSTERIOR] = view
    return view


def prior_precision(bnn: BayesianModel, config: LaplaceConfig) -> torch.Tensor:
    """τ: ``[1]`` (scalar) or ``[L]`` (one per wrapped layer)."""
    taus = torch.stack([layer.prior_precision for layer in layers(bnn).values()])
    return taus if config.prior_per_layer and len(taus) > 1 else taus[:1]


def set_prior_precision(bnn: BayesianModel, tau: torch.Tensor | float) -> None:
    tau = torch.as_tensor(tau, dtype=torch.float64).reshape(-1)
    for i, layer in enumerate(layers(bnn).values()):
        layer.prior_precision.fill_(float(tau[i if tau.numel() > 1 else 0]))


def log_marginal_likelihood(bnn: BayesianModel, config: LaplaceConfig,
                            tau: torch.Tensor | None = None) -> torch.Tensor:
    """Laplace evidence at τ (default: the current prior precision); differentiable in τ."""
    loss = train_loss(bnn)
    if loss is None:
        raise BayesifyError("call bayesify.fit(bnn, loader) before the marginal likelihood")
    view = posterior(bnn, config)
    found = list(layers(bnn).values())
    tau = prior_precision(bnn, config) if tau is None else tau
    tau = tau.to(view.h.dtype if hasattr(view, "h") else view.eig.dtype)
    if last_layer(bnn):
        sq = view.mean.square().sum().reshape(1)
        sizes = [view.num_params]
    else:
        sq = torch.stack([layer.map_vector().detach().square().sum() for layer in found])
        sizes = [layer.num_params() for layer in found]
        if tau.numel() == 1:
            sq, sizes = sq.sum().reshape(1), [sum(sizes)]
    return post.log_marginal_likelihood(
        view.log_det(tau), tau, loss=loss.to(tau), map_sq_norms=sq.to(tau), sizes=sizes,
    )


def evidence_record(bnn: BayesianModel, config: LaplaceConfig) -> dict[str, Any]:
    """``{prior_precision, log_marginal_likelihood}`` at the installed τ."""
    with torch.no_grad():
        evidence = float(log_marginal_likelihood(bnn, config))
    return {"prior_precision": prior_precision(bnn, config).tolist(),
            "log_marginal_likelihood": evidence}


def param_names(found: dict[str, LaplaceLayer]) -> list[str]:
    """functional_call keys of the subnetwork parameters (the base layers' own tensors)."""
    return [wrapped_name(lname, p) for lname, layer in found.items()
            for p, _ in layer.posterior_parameters()]


def chunk(bnn: BayesianModel, config: LaplaceConfig, x: torch.Tensor, num_params: int) -> int:
    """Examples per chunk of per-example Jacobians: ``B·C·P ≤ jacobian_chunk``."""
    classes = bnn.runtime.get(_CLASSES)
    if classes is None:
        with torch.no_grad():
            classes = bnn.runtime[_CLASSES] = logits_of(bnn.model(x[:1])).shape[-1]
    return max(1, config.jacobian_chunk // max(1, classes * num_params))


class capturing:
    """Context manager: the layer keeps its input/output during the block, then forgets them."""

    def __init__(self, layer: LaplaceLayer) -> None:
        self.layer = layer

    def __enter__(self) -> LaplaceLayer:
        self.layer.capturing = True
        return self.layer

    def __exit__(self, *exc: object) -> None:
        self.layer.capturing = False
        self.layer.captured = None
