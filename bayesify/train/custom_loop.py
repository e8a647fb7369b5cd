"""What a custom training loop needs from bayesify besides :func:`bayesify.elbo_loss`.

``fit`` takes the posterior's learning rate and optimiser from the family's step and,
at the end, chooses the family's declared knobs on validation data. A loop of your own
(Lightning, ``accelerate``, the Hugging Face ``Trainer``) gets the same two things::

    opt = bayesify.posterior_optimizer(bnn)            # the family's LR, SGD Nesterov
    for batch in loader:                               # ... your loop
        bayesify.elbo_loss(bnn, batch, n_train=N).loss.backward(); opt.step(); ...
    bayesify.tune(bnn, val_loader)                     # the validation knob search

:func:`param_groups` gives the groups alone (posterior at the family's LR, no weight
decay; base weights only with ``base_lr > 0``, and only those you left trainable) for
an optimiser of your choice. The posterior LR is large (ibnn 0.2, rank1 0.05·K, ...):
a fine-tuning LR such as the Trainer's 5e-5 leaves the posterior where it started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bayesify.errors import BayesifyError
from bayesify.train.loop import FIT_FALLBACKS
from bayesify.train.steps import optimiser_groups

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def posterior_lr(bnn: BayesianModel) -> float:
    """The learning rate ``fit`` gives the posterior group when ``lr`` is not set."""
    lr = bnn.method.step().defaults.get("lr")
    if lr is None:
        raise BayesifyError(f"method {bnn.method_name!r} takes no gradient steps (its posterior "
                            "is built by bayesify.fit); it has no posterior learning rate")
    return float(lr)


def param_groups(bnn: BayesianModel, *, lr: float | None = None, base_lr: float = 0.0,
                 weight_decay: float = 0.0, base_weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """Optimiser groups as ``fit`` builds them: the family's posterior group(s) at ``lr``
    (default :func:`posterior_lr`) and, with ``base_lr > 0``, the base weights you left
    trainable. With ``base_lr == 0`` the base stays frozen, as in ``fit``."""
    lr = posterior_lr(bnn) if lr is None else float(lr)
    groups = optimiser_groups(bnn, bnn.method.step(), lr=lr, weight_decay=weight_decay,
                              base_lr=base_lr, base_weight_decay=base_weight_decay)
    return groups


def posterior_optimizer(bnn: BayesianModel, *, lr: float | None = None, base_lr: float = 0.0,
                        optimizer: str | None = None, **group_options: Any) -> torch.optim.Optimizer:
    """The optimiser ``fit`` would use: :func:`param_groups` under the family's optimiser
    (SGD with Nesterov momentum 0.9 unless the family's step says otherwise)."""
    defaults = {**FIT_FALLBACKS, **bnn.method.step().defaults}
    kind = optimizer or defaults["optimizer"]
    groups = param_groups(bnn, lr=lr, base_lr=base_lr, **group_options)
    first = groups[0]["lr"]
    if kind == "sgd":
        momentum = float(defaults["momentum"])
        return torch.optim.SGD(groups, lr=first, momentum=momentum, nesterov=momentum > 0)
    if kind in ("adam", "adamw"):
        return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(groups, lr=first)
    raise BayesifyError(f"unknown optimizer {kind!r}; use 'sgd', 'adam' or 'adamw'")
