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

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from bayesify.errors import BayesifyError
from bayesify.train.budget import small_batch_factor
from bayesify.train.guard import StepGuard
from bayesify.train.loop import FIT_FALLBACKS
from bayesify.train.steps import guarded_update, optimiser_groups

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def posterior_lr(bnn: BayesianModel, *, batch_size: int | None = None) -> float:
    """The learning rate ``fit`` gives the posterior group when ``lr`` is not set;
    ``batch_size``: examples per optimiser step (over ranks and accumulation) — below 16 the
    rate is scaled down as ``fit`` scales it (:func:`~bayesify.train.budget.small_batch_factor`)."""
    step = bnn.method.step()
    lr = step.defaults.get("lr")
    if lr is None:
        why = (step.refusal if step.trains_nothing
               else "its posterior is built by bayesify.fit")
        raise BayesifyError(f"method {bnn.method_name!r} takes no gradient steps ({why}); it "
                            "has no posterior learning rate")
    kind = {**FIT_FALLBACKS, **step.defaults}["optimizer"]
    return float(lr) * small_batch_factor(examples_per_step=batch_size, optimizer=kind)


def param_groups(bnn: BayesianModel, *, lr: float | None = None, base_lr: float = 0.0,
                 weight_decay: float = 0.0, base_weight_decay: float = 0.0,
                 batch_size: int | None = None) -> list[dict[str, Any]]:
    """Optimiser groups as ``fit`` builds them: the family's posterior group(s) at ``lr``
    (default :func:`posterior_lr`) and, with ``base_lr > 0``, the base weights you left
    trainable. With ``base_lr == 0`` the base stays frozen, as in ``fit``."""
    lr = posterior_lr(bnn, batch_size=batch_size) if lr is None else float(lr)
    groups = optimiser_groups(bnn, bnn.method.step(), lr=lr, weight_decay=weight_decay,
                              base_lr=base_lr, base_weight_decay=base_weight_decay)
    return groups


def posterior_optimizer(bnn: BayesianModel, *, lr: float | None = None, base_lr: float = 0.0,
                        optimizer: str | None = None, **group_options: Any) -> torch.optim.Optimizer:
    """The optimiser ``fit`` would use: :func:`param_groups` under the family's optimiser
    (SGD with Nesterov momentum 0.9 unless the family's step says otherwise); ``batch_size``
    as in :func:`posterior_lr`."""
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


class GuardedStep:
    """The step guard of ``fit`` for a loop of your own: a step that produces a non-finite
    loss or gradient, a diverging loss or unusable values is undone, the learning rate of
    every group halved (a warning says so) and the loop goes on;
    :class:`~bayesify.errors.NonFiniteLossError` after
    :data:`~bayesify.train.guard.MAX_RECOVERIES` recoveries::

        opt = bayesify.posterior_optimizer(bnn)
        guard = bayesify.GuardedStep(bnn, opt, clip_grad_norm=1.0)
        for batch in loader:
            loss = bayesify.elbo_loss(bnn, batch, n_train=N, check_finite=False).loss
            loss.backward()
            guard.step(loss)          # False: the step was undone and the lr halved

    ``step`` calls ``optimizer.step()`` and ``zero_grad()`` itself. Single process (under
    ``torchrun`` use ``bayesify.fit``, whose ranks agree on every recovery). A learning-rate
    scheduler that rewrites ``group["lr"]`` from its own base rates (``LambdaLR``) should be
    given as ``scheduler=``: its base rates are halved too.
    """

    def __init__(self, bnn: BayesianModel, optimizer: torch.optim.Optimizer, *,
                 clip_grad_norm: float | None = None, scheduler: Any = None) -> None:
        self.bnn, self.optimizer, self.scheduler = bnn, optimizer, scheduler
        self.clip_grad_norm = clip_grad_norm
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.global_step = 0
        self.epoch = 0
        self.ctx = SimpleNamespace(is_main=True, distributed=False)
        self.guard = StepGuard(bnn)
        self.guard.begin()
        self.guard.keep_anchor(self.trainable(), 0)

    def trainable(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self, loss: torch.Tensor | float) -> bool:
        """After ``loss.backward()``: the optimiser step, or its recovery (``False``)."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        where = f"custom-loop step {self.global_step}"
        halved = [g["lr"] for g in self.optimizer.param_groups]
        ok = self._step(value, where)
        if not ok and self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [b * new / old if old else b for b, new, old in zip(
                self.scheduler.base_lrs, [g["lr"] for g in self.optimizer.param_groups], halved)]
        self.guard.begin()  # buffers the next forward may change
        self.guard.keep_anchor(self.trainable(), self.global_step)
        return ok

    def _step(self, value: float, where: str) -> bool:
        return guarded_update(self, self.guard, where, value,
                              lambda: "the loss of the caller's step")
