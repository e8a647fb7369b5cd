"""Adapters that put the peer libraries behind bayesify's predictor interface.

Used by ``benchmarks/quality.py`` and ``benchmarks/overhead.py`` to compare side
by side; the peers are optional (``pip install "bayesify[bench]"``) and imported
lazily.

* laplace-torch: :func:`fit_laplace_torch` + :class:`LaplaceTorchPredictor` (the
  probit GLM predictive is a single distribution, exposed as one "member").
* bayesian-torch: :func:`to_bayesian_torch`, :func:`fit_bayesian_torch` and the KL
  helpers. bayesian-torch's ``get_kl_loss`` returns Σ_tensors mean_i KL_i — every
  weight tensor's KL *averaged* over its elements — whereas the ELBO needs the
  KL summed over all weights, divided by N_train for a per-example loss. We train
  with :func:`bayesian_torch_kl_sum` / N_train. (bayesian-torch's option
  ``prior_sigma`` / ``prior_variance`` is used as a standard deviation.)
* :class:`SampledModelPredictor`: M stochastic forward passes of a plain module
  (bayesian-torch weight samples, MC dropout masks) with a fixed seed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.batch import Batch
from bayesify.core.outputs import logits_of
from bayesify.core.walker import replace_modules
from bayesify.errors import BayesifyError
from bayesify.predict.predictor import BasePredictor


def _require(module: str, dist: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise BayesifyError(
            f"{dist} is not installed; install the benchmark extra: pip install -e '.[bench]'"
        ) from err


def _eval_bn(model: nn.Module) -> None:
    """Keep BatchNorm in eval (frozen pretrained statistics), as bayesify fine-tuning does."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


# -- laplace-torch ---------------------------------------------------------------------------

def fit_laplace_torch(
    model: nn.Module,
    train_loader: Iterable,
    *,
    subset_of_weights: str = "last_layer",
    hessian_structure: str = "kron",
    prior: str = "marglik",
    val_loader: Iterable | None = None,
) -> Any:
    """laplace-torch's Laplace around ``model`` (eval mode) with a tuned prior precision.

    ``prior="marglik"``: laplace-torch's marginal-likelihood optimisation of the
    prior precision; ``"gridsearch"`` uses the validation NLL on ``val_loader``.
    """
    laplace = _require("laplace", "laplace-torch")
    model = copy.deepcopy(model).eval()
    first, keys = next(iter(train_loader)), {}
    if isinstance(first, Mapping):  # Hugging Face batches: laplace-torch calls model(batch)
        model = MappingModel(model).eval()
        inputs = [k for k in first if k != "labels"]
        keys = {"dict_key_x": "input_ids" if "input_ids" in inputs else inputs[0]}
    la = laplace.Laplace(model, "classification", subset_of_weights=subset_of_weights,
                         hessian_structure=hessian_structure, **keys)
    la.fit(train_loader)
    if prior == "marglik":
        la.optimize_prior_precision(pred_type="glm", method="marglik", link_approx="probit")
    elif prior == "gridsearch":
        la.optimize_prior_precision(pred_type="glm", method="gridsearch", link_approx="probit",
                                    val_loader=val_loader)
    else:
        raise BayesifyError(f"prior must be 'marglik' or 'gridsearch', got {prior!r}")
    return la


class MappingModel(nn.Module):
    """``model(**inputs)`` called as ``wrapper(batch)``: laplace-torch's convention for a model
    fed mappings (it calls ``model(batch)`` with the labels still in the batch)."""

    def __init__(self, model: nn.Module, labels: str = "labels") -> None:
        super().__init__()
        self.model, self.labels = model, labels

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        return logits_of(self.model(**{k: v for k, v in batch.items() if k != self.labels}))


class LaplaceTorchPredictor(BasePredictor):
    """laplace-torch's predictive ``p(y|x)`` as one member: logits = log p (softmax = p).

    The probit GLM predictive is a single distribution, so MI is 0 by construction;
    ``pred_type="nn"`` / ``link_approx="mc"`` give the same single averaged distribution.
    """

    def __init__(self, la: Any, *, pred_type: str = "glm", link_approx: str = "probit",
                 temperature: float = 1.0) -> None:
        self.la = la
        self.pred_type = pred_type
        self.link_approx = link_approx
        self.temperature = float(temperature)

    @property
    def device(self) -> torch.device:
        return next(self.la.model.parameters()).device

    @torch.no_grad()
    def member_logits(self, x: Any) -> torch.Tensor:
        if isinstance(x, Batch):  # a mapping model (MappingModel): laplace-torch takes a dict
            x = dict(x.to(self.device).kwargs) if x.kwargs else x.args[0]
        probs = self.la(x.to(self.device) if isinstance(x, torch.Tensor) else x,
                        pred_type=self.pred_type, link_approx=self.link_approx)
        return probs.float().clamp_min(1e-12).log().unsqueeze(0)


# -- bayesian-torch --------------------------------------------------------------------------

def to_bayesian_torch(
    model: nn.Module,
    *,
    moped_delta: float = 0.1,
    prior_mu: float = 0.0,
    prior_sigma: float = 1.0,
    posterior_rho_init: float = -3.0,
    layer_type: str = "Reparameterization",
) -> nn.Module:
    """A deep copy of ``model`` converted by bayesian-torch's ``dnn_to_bnn`` with MOPED.

    MOPED: posterior means start at the pretrained weights, std = δ·|w|.
    """
    dnn_to_bnn = _require("bayesian_torch.models.dnn_to_bnn", "bayesian-torch").dnn_to_bnn
    model = copy.deepcopy(model)
    dnn_to_bnn(model, {
        "prior_mu": prior_mu, "prior_sigma": prior_sigma, "posterior_mu_init": 0.0,
        "posterior_rho_init": posterior_rho_init, "type": layer_type,
        "moped_enable": True, "moped_delta": moped_delta,
    })
    return model


def _variational_tensors(model: nn.Module) -> Iterable[tuple[torch.Tensor, torch.Tensor, Any, Any]]:
    """``(mu, rho, prior_mu, prior_sigma)`` of every bayesian-torch weight/bias tensor."""
    for layer in model.modules():
        if not hasattr(layer, "kl_loss"):
            continue
        for mu_name, rho_name, prior in (("mu_kernel", "rho_kernel", "weight"),
                                         ("mu_weight", "rho_weight", "weight"),
                                         ("mu_bias", "rho_bias", "bias")):
            mu, rho = getattr(layer, mu_name, None), getattr(layer, rho_name, None)
            if isinstance(mu, torch.Tensor) and isinstance(rho, torch.Tensor):
                yield (mu, rho, getattr(layer, f"prior_{prior}_mu"),
                       getattr(layer, f"prior_{prior}_sigma"))


def bayesian_torch_kl_sum(model: nn.Module) -> torch.Tensor:
    """KL(q‖p) summed over every weight: Σ_i log σ_p/σ_i + (σ_i² + (μ_i − μ_p)²)/(2σ_p²) − ½."""
    total = torch.zeros(())
    for mu, rho, prior_mu, prior_sigma in _variational_tensors(model):
        sigma = F.softplus(rho)
        kl = (torch.log(prior_sigma) - torch.log(sigma)
              + (sigma**2 + (mu - prior_mu) ** 2) / (2 * prior_sigma**2) - 0.5)
        total = total + kl.sum()
    return total


def bayesian_torch_kl_mean(model: nn.Module) -> torch.Tensor:
    """bayesian-torch's own ``get_kl_loss``: per-tensor *means* of the KL, summed."""
    get_kl_loss = _require("bayesian_torch.models.dnn_to_bnn", "bayesian-torch").get_kl_loss
    return get_kl_loss(model)


def fit_bayesian_torch(
    model: nn.Module,
    train_loader: Iterable,
    *,
    epochs: int,
    lr: float = 1e-3,
    n_train: int | None = None,
    kl_anneal_epochs: float = 0.0,
) -> dict[str, float]:
    """ELBO fine-tuning: loss = CE + β(t) · KL_sum / N_train, Adam, BatchNorm frozen."""
    n_train = n_train or len(train_loader.dataset)  # type: ignore[attr-defined]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    steps = max(1, len(train_loader))  # type: ignore[arg-type]
    last: dict[str, float] = {}
    for epoch in range(epochs):
        model.train()
        _eval_bn(model)
        for step, (x, y) in enumerate(train_loader):
            progress = epoch + step / steps
            beta = min(1.0, progress / kl_anneal_epochs) if kl_anneal_epochs > 0 else 1.0
            nll = F.cross_entropy(model(x), y)
            kl = bayesian_torch_kl_sum(model)
            loss = nll + beta * kl / n_train
            if not torch.isfinite(loss):
                raise BayesifyError(f"bayesian-torch loss is not finite at epoch {epoch}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last = {"nll": nll.item(), "kl": kl.item(), "beta": beta}
    model.eval()
    return last


# -- sampled plain modules (bayesian-torch, MC dropout) ----------------------------------------

class SampledModelPredictor(BasePredictor):
    """M stochastic forwards of ``model``: member m is forward number m after ``seed``.

    ``stochastic``: module types kept in train mode at prediction (e.g. ``nn.Dropout``);
    everything else (BatchNorm) is in eval. The global RNG is forked, so prediction
    does not disturb the caller's random state.
    """

    def __init__(self, model: nn.Module, members: int, *, seed: int = 0,
                 stochastic: tuple[type[nn.Module], ...] = (), temperature: float = 1.0) -> None:
        if members <= 0:
            raise BayesifyError(f"members must be positive, got {members}")
        self.model = model
        self.members = int(members)
        self.seed = seed
        self.stochastic = stochastic
        self.temperature = float(temperature)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward_members(self, x: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        for m in self.model.modules():
            if isinstance(m, self.stochastic):
                m.train()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            outs = [self.model(x.to(self.device)).float() for _ in range(self.members)]
        self.model.eval()
        return torch.stack(outs)

    @torch.no_grad()
    def member_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_members(x)

    def differentiable_member_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_members(x)


# -- MC dropout, written the way a user of plain PyTorch would ----------------------------------

def insert_dropout(model: nn.Module, p: float, *, skip_first: bool = True) -> nn.Module:
    """A copy with ``nn.Dropout(p)`` before every Conv/Linear (but the stem when ``skip_first``)."""
    if not 0.0 < p < 1.0:
        raise BayesifyError(f"dropout p must lie in (0, 1), got {p}")
    model = copy.deepcopy(model)
    targets = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    modules = dict(model.named_modules())
    replace_modules(model, {name: nn.Sequential(nn.Dropout(p), modules[name])
                            for name in (targets[1:] if skip_first else targets)})
    return model


def fit_plain(model: nn.Module, train_loader: Iterable, *, epochs: int, lr: float = 1e-3,
              weight_decay: float = 5e-4) -> nn.Module:
    """Fine-tune every weight with AdamW + cross-entropy, BatchNorm frozen (dropout active)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(epochs):
        model.train()
        _eval_bn(model)
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    return model


def kl_scaling_note(model: nn.Module) -> dict[str, float]:
    """Both KL conventions for one bayesian-torch model (documents the quirk numerically)."""
    total = bayesian_torch_kl_sum(model).item()
    mean = bayesian_torch_kl_mean(model).item()
    count = sum(mu.numel() for mu, *_ in _variational_tensors(model))
    return {"kl_sum": total, "kl_get_kl_loss": mean, "weights": float(count),
            "ratio": total / mean if mean else math.nan}
