"""What a custom training loop needs from bayesify besides :func:`bayesify.elbo_loss`.

``fit`` picks the posterior's learning rate and optimiser from the family and, at
the end, chooses the family's predictive-scale knob on validation data. A loop of
your own (Lightning, ``accelerate``, the Hugging Face ``Trainer``) gets the same
two things here::

    opt = bayesify.posterior_optimizer(bnn)            # the family's LR, SGD Nesterov
    for batch in loader:                               # ... your loop
        bayesify.elbo_loss(bnn, batch, n_train=N).loss.backward(); opt.step(); ...
    bayesify.tune(bnn, val_loader)                     # the validation knob search

:func:`param_groups` gives the groups alone (posterior at the family's LR, no
weight decay; base weights only with ``base_lr > 0``) for an optimiser of your
choice. The posterior LR is large (ibnn 0.2, rank1 0.05·K, ...): a fine-tuning LR
such as the Trainer's 5e-5 leaves the posterior where it started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.batch import BatchFn
    from bayesify.core.model import BayesianModel


def posterior_lr(bnn: BayesianModel) -> float:
    """The learning rate ``fit`` gives the posterior group when ``lr`` is not set."""
    return float(bnn.method.fit_defaults().get("lr", bnn.method.default_lr()))


def param_groups(bnn: BayesianModel, *, lr: float | None = None, base_lr: float = 0.0,
                 weight_decay: float = 0.0, base_weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """Optimiser groups as ``fit`` builds them: the family's posterior group(s) at ``lr``
    (default :func:`posterior_lr`) and, with ``base_lr > 0``, the unfrozen base weights.

    With ``base_lr == 0`` the base stays frozen (``requires_grad=False``), as in ``fit``.
    """
    lr = posterior_lr(bnn) if lr is None else float(lr)
    groups = bnn.method.param_groups(bnn, lr=lr, weight_decay=weight_decay)
    bnn.set_base_trainable(base_lr > 0)
    if base_lr > 0:
        groups.append({"params": bnn.base_parameters(), "lr": base_lr,
                       "weight_decay": base_weight_decay, "name": "base"})
    if not any(g["params"] for g in groups):
        raise BayesifyError(
            f"method {bnn.method_name!r} has no trainable posterior parameters (e.g. dropout "
            "with train_weights=False, or a post-hoc family); nothing to optimise: call "
            "bayesify.tune(bnn, val_loader) directly, or use base_lr > 0")
    return groups


def posterior_optimizer(bnn: BayesianModel, *, lr: float | None = None, base_lr: float = 0.0,
                        optimizer: str | None = None, **group_options: Any) -> torch.optim.Optimizer:
    """The optimiser ``fit`` would use: :func:`param_groups` under the family's optimiser
    (SGD with Nesterov momentum 0.9 unless the family says otherwise)."""
    defaults = {"optimizer": "sgd", "momentum": 0.9, **bnn.method.fit_defaults()}
    kind = optimizer or defaults["optimizer"]
    groups = param_groups(bnn, lr=lr, base_lr=base_lr, **group_options)
    first = groups[0]["lr"]
    if kind == "sgd":
        momentum = float(defaults["momentum"])
        return torch.optim.SGD(groups, lr=first, momentum=momentum, nesterov=momentum > 0)
    if kind in ("adam", "adamw"):
        return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(groups, lr=first)
    raise BayesifyError(f"unknown optimizer {kind!r}; use 'sgd', 'adam' or 'adamw'")


def tune(bnn: BayesianModel, val_loader: Any, *, batch_fn: BatchFn | None = None) -> dict[str, Any]:
    """Run the family's validation search after any training loop; returns its record.

    The family's one predictive-scale knob (ibnn/rank1/meanfield: spread multiplier;
    dropout: rate multiplier; batchensemble/ensemble: member temperature; hypernet:
    noise multiplier) is chosen on ``val_loader`` by the search ``fit(...,
    val_loader=...)`` runs at its end, installed in ``bnn.state`` (saved and exported
    with the posterior) and described in the returned record
    (``{knob, knob_grid, knob_val_nll}``). Post-hoc MC dropout (``train_weights=False``)
    needs no training pass: ``tune`` alone is its fit. SWAG and Laplace build their
    posterior inside ``fit`` (snapshots, curvature): use ``fit``, which tunes them too.
    """
    if val_loader is None:
        raise BayesifyError("tune needs a validation loader (batches with labels)")
    method = bnn.method
    if method.training != "elbo" or getattr(method.config, "snapshot", False):
        raise BayesifyError(
            f"method {method.name!r} builds its posterior inside bayesify.fit "
            f"({'snapshots of SGD' if method.training != 'curvature' else 'a curvature pass'}), "
            "so a custom loop cannot produce it: use bayesify.fit(bnn, train_loader, "
            "val_loader=val_loader), which also runs the validation search")
    was_training = bnn.training
    try:
        record = method.finish_fit(bnn, train_loader=None, val_loader=val_loader, ctx=None,
                                   batch_fn=batch_fn)
    finally:
        bnn.train(was_training)
    if not record:
        raise BayesifyError(f"method {method.name!r} has no predictive-scale knob to tune")
    return dict(record)
