"""The training loss as a public function, for users who keep their own loop
(Lightning, ``accelerate``, the Hugging Face ``Trainer``).

``elbo_loss(bnn, batch, n_train=N)`` is exactly what one micro-batch of
``bayesify.fit`` computes: the family's batch layout (the batch tiled over
components / samples), the mean NLL over the tiled rows, and the family's KL
weighted per training example::

    loss = mean NLL + β · w · KL(q‖p) / N_train

(``w`` the family's minibatch KL weighting, 1 unless given; KL = 0 for families
without a variational term). Optimise
``bnn.method.step().param_groups(bnn, lr=..., weight_decay=0)`` (or simply
``bnn.posterior_parameters()``) and leave the base frozen, as ``fit`` does; for a
family's predictive-scale knob call ``bayesify.tune(bnn, val_loader)`` after training.
Hugging Face ``Trainer``::

    class BayesTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            terms = bayesify.elbo_loss(model, inputs, n_train=len(self.train_dataset))
            return (terms.loss, terms) if return_outputs else terms.loss

``batch`` follows :mod:`bayesify.core.batch` (``(x, y)``, mappings with ``labels``,
``batch_fn=``). The model should be in ``train()`` mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bayesify.core.batch import BatchFn, split_batch
from bayesify.errors import BayesifyError, NonFiniteLossError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


@dataclass(frozen=True)
class LossTerms:
    """``loss`` (differentiable), its ``nll`` and ``kl`` parts (KL summed, not divided)."""

    loss: torch.Tensor
    nll: torch.Tensor
    kl: torch.Tensor


def nll_and_kl(bnn: BayesianModel, inputs: Any, labels: torch.Tensor,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean NLL over the family's tiled batch and the summed KL (fp32): ``Step.terms`` of
    the family's step, exactly what one micro-batch of ``fit`` computes."""
    return bnn.method.step().terms(bnn, inputs, labels, generator)


def elbo_loss(bnn: BayesianModel, batch: Any, *, n_train: int, beta: float = 1.0,
              kl_weight: float = 1.0, batch_fn: BatchFn | None = None,
              generator: torch.Generator | None = None, check_finite: bool = True) -> LossTerms:
    """The loss ``fit`` minimises, for one batch of a custom training loop.

    ``check_finite``: a non-finite loss raises :class:`~bayesify.errors.NonFiniteLossError`
    (what diverged and what to do) instead of handing a NaN to ``backward()``; pass
    ``False`` when :class:`bayesify.GuardedStep` handles it (it undoes the step and
    halves the learning rate)."""
    if isinstance(n_train, bool) or not isinstance(n_train, int) or n_train <= 0:
        raise BayesifyError(f"n_train must be the positive number of training examples, "
                            f"got {n_train!r}")
    parts = split_batch(batch, batch_fn).to(bnn.device)
    labels = parts.require_labels("elbo_loss")
    nll, kl = nll_and_kl(bnn, parts.model_input(), labels, generator)
    if check_finite:
        values = torch.stack([nll.detach(), kl.detach()])
        if not bool(torch.isfinite(values).all()):
            raise NonFiniteLossError(
                f"elbo_loss of method {bnn.method_name!r} is non-finite (nll={float(nll):.4g}, "
                f"kl={float(kl):.4g}): the inputs hold NaN/inf, or an earlier optimiser step "
                "diverged and left the posterior non-finite. Lower the posterior learning rate, "
                "clip the gradient norm (fit's families clip at 1), or let "
                "bayesify.GuardedStep(bnn, optimizer) undo such steps and halve the rate")
    return LossTerms(loss=nll + beta * kl_weight * kl / n_train, nll=nll, kl=kl)
