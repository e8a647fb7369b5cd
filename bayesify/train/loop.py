"""``bayesify.fit``: loss = mean NLL over the tiled batch + β(t)·KL / N_train.

One loop for every gradient-trained family; post-hoc families (``method.fit``)
take over the data loop themselves. The loop keeps its state in a
:class:`TrainState` (no globals) so distributed training and resume can extend it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from bayesify.errors import BayesifyError, NonFiniteLossError
from bayesify.train.schedules import beta_schedule, lr_factor

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


@dataclass
class FitResult:
    """What ``fit`` returns: one dict per epoch (loss, nll, kl, beta, lr, val_*)."""

    history: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.history[i]

    def __len__(self) -> int:
        return len(self.history)

    @property
    def last(self) -> dict[str, Any]:
        return self.history[-1]


@dataclass
class TrainState:
    bnn: "BayesianModel"
    optimizer: torch.optim.Optimizer
    base_lrs: list[float]
    schedules: list[Any]
    epochs: int
    steps_per_epoch: int
    n_train: int
    kl_anneal_epochs: float
    beta_max: float
    epoch: int = 0
    step: int = 0


def build_optimizer(
    bnn: "BayesianModel",
    *,
    lr: float,
    base_lr: float,
    optimizer: str,
    momentum: float,
    weight_decay: float,
    base_weight_decay: float,
) -> torch.optim.Optimizer:
    """Posterior group (large LR, no weight decay) + base group when ``base_lr > 0``."""
    posterior = [p for p in bnn.posterior_parameters() if p.requires_grad]
    groups = [{"params": posterior, "lr": lr, "weight_decay": weight_decay, "name": "posterior"}]
    if base_lr > 0:
        bnn.set_base_trainable(True)
        groups.append({"params": bnn.base_parameters(), "lr": base_lr,
                       "weight_decay": base_weight_decay, "name": "base"})
    else:
        bnn.set_base_trainable(False)
    if not any(g["params"] for g in groups):
        raise BayesifyError(
            f"method {bnn.method_name!r} has no trainable parameters; use base_lr > 0 "
            "or a gradient-trained family"
        )
    if optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0)
    if optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise BayesifyError(f"unknown optimizer {optimizer!r}; use 'sgd', 'adam' or 'adamw'")


def _batches(loader: Iterable, device: torch.device):
    for batch in loader:
        x, y = batch[0], batch[1]
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train_step(state: TrainState, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One optimisation step; returns the step's loss terms."""
    progress = state.epoch + state.step / max(state.steps_per_epoch, 1)
    beta = beta_schedule(progress, anneal_epochs=state.kl_anneal_epochs, beta_max=state.beta_max)
    for group, base, schedule in zip(state.optimizer.param_groups, state.base_lrs, state.schedules):
        group["lr"] = base * lr_factor(progress, schedule, epochs=state.epochs)
    logits, targets = state.bnn.training_forward(x, y)
    nll = F.cross_entropy(logits.float(), targets)
    kl = state.bnn.kl().float()
    loss = nll + beta * kl / state.n_train
    if not torch.isfinite(loss):
        raise NonFiniteLossError(
            f"non-finite loss at epoch {state.epoch}, step {state.step} "
            f"(nll={nll.item():.4g}, kl={kl.item():.4g}); lower the learning rate "
            "or check the inputs for NaN/inf"
        )
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    state.optimizer.step()
    state.step += 1
    return {"loss": loss.item(), "nll": nll.item(), "kl": kl.item(), "beta": beta}


def fit(
    bnn: "BayesianModel",
    train_loader: Iterable,
    *,
    epochs: int = 1,
    lr: float | None = None,
    base_lr: float = 0.0,
    kl_anneal_epochs: float = 0.0,
    beta: float = 1.0,
    lr_schedule: Any = "constant",
    base_lr_schedule: Any = "constant",
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    base_weight_decay: float = 0.0,
    n_train: int | None = None,
    val_loader: Iterable | None = None,
    device: str | torch.device | None = None,
    log_dir: str | Path | None = None,
    progress: bool = True,
    **method_kwargs: Any,
) -> FitResult:
    """Fine-tune the posterior of ``bnn`` on ``train_loader``.

    Loss per step: mean NLL over the tiled batch + β(t)·KL/N_train, β(t) linear
    0 → ``beta`` over ``kl_anneal_epochs`` (fixed when 0). Posterior group: SGD
    Nesterov at ``lr`` (default: the family's), no weight decay; base weights stay
    frozen unless ``base_lr > 0``. Post-hoc families delegate to ``method.fit``.
    """
    if epochs <= 0:
        raise BayesifyError(f"epochs must be positive, got {epochs}")
    if device is not None:
        bnn.to(device)
    n_train = n_train or _dataset_size(train_loader)
    if not bnn.method.gradient_trained:
        info = bnn.method.fit(bnn, train_loader, epochs=epochs, lr=lr, device=bnn.device,
                              progress=progress, **method_kwargs)
        return FitResult(history=[info or {}])
    if method_kwargs:
        raise BayesifyError(f"unknown fit option(s) {sorted(method_kwargs)}")
    lr = lr if lr is not None else bnn.method.default_lr()
    opt = build_optimizer(bnn, lr=lr, base_lr=base_lr, optimizer=optimizer, momentum=momentum,
                          weight_decay=weight_decay, base_weight_decay=base_weight_decay)
    schedules = [lr_schedule, base_lr_schedule][: len(opt.param_groups)]
    state = TrainState(
        bnn=bnn, optimizer=opt, base_lrs=[g["lr"] for g in opt.param_groups],
        schedules=schedules, epochs=epochs, steps_per_epoch=_num_batches(train_loader),
        n_train=n_train, kl_anneal_epochs=kl_anneal_epochs, beta_max=beta,
    )
    result = FitResult()
    log_path = Path(log_dir) / "history.jsonl" if log_dir is not None else None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    for epoch in range(epochs):
        state.epoch, state.step = epoch, 0
        record = _train_epoch(state, train_loader, progress=progress)
        if val_loader is not None:
            metrics = bnn.predictor().evaluate(val_loader)
            record.update({f"val_{k}": v for k, v in metrics.items() if isinstance(v, float)})
        result.history.append(record)
        if log_path is not None:
            with log_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
    bnn.eval()
    return result


def _train_epoch(state: TrainState, loader: Iterable, *, progress: bool) -> dict[str, Any]:
    bnn = state.bnn
    bnn.train()
    start = time.perf_counter()
    totals = {"loss": 0.0, "nll": 0.0, "kl": 0.0}
    count = 0
    bar = tqdm(total=state.steps_per_epoch or None, desc=f"epoch {state.epoch + 1}/{state.epochs}",
               disable=not progress, leave=False, dynamic_ncols=True)
    beta = 0.0
    for x, y in _batches(loader, bnn.device):
        terms = train_step(state, x, y)
        beta = terms["beta"]
        for k in totals:
            totals[k] += terms[k]
        count += 1
        bar.update(1)
        bar.set_postfix(loss=f"{terms['loss']:.4f}", nll=f"{terms['nll']:.4f}",
                        kl=f"{terms['kl']:.1f}", beta=f"{beta:.2f}")
    bar.close()
    if count == 0:
        raise BayesifyError("the training loader produced no batches")
    record = {k: v / count for k, v in totals.items()}
    record.update({
        "epoch": state.epoch + 1,
        "steps": count,
        "beta": beta,
        "lr": state.optimizer.param_groups[0]["lr"],
        "seconds": time.perf_counter() - start,
    })
    return record


def _dataset_size(loader: Iterable) -> int:
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        raise BayesifyError("cannot infer N_train from the loader; pass n_train=...")
    return len(dataset)


def _num_batches(loader: Iterable) -> int:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return 0
