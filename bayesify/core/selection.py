"""One validation search for every family's predictive-scale knob.

A family exposes one knob with a plain meaning (SWAG's covariance scale, Laplace's
prior precision τ, …) and a ``set_knob(value)`` that installs it. For every value
on a log grid the predictive's per-example NLL on the validation split is
computed; the rule picks the value:

* ``"min"``: the lowest mean NLL;
* ``"one_se"``: among values whose mean NLL is within one standard error of the
  lowest (``mean(v) ≤ mean(v*) + sd(nll(v*)) / sqrt(n)``), the broadest posterior
  (``prefer="largest"`` for a scale, ``"smallest"`` for a precision). On a small or
  perfectly classified validation split the minimum is decided by one or two
  points; the rule keeps the broadest predictive the data cannot tell apart from
  it, which is what holds up under shift.

The chosen value stays installed; the curve goes into the fit history.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from bayesify.core.batch import iter_batches
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def log_grid(spec: tuple[float, float, int]) -> list[float]:
    """``(low, high, count)`` → ``count`` log-spaced values."""
    low, high, count = spec
    return torch.logspace(math.log10(low), math.log10(high), int(count),
                          dtype=torch.float64).tolist()


@torch.no_grad()
def validation_nll(bnn: BayesianModel, batches: list[Any]) -> torch.Tensor:
    """``[n]`` per-example NLL of ``bnn``'s default predictor over ``batches``."""
    predictor = bnn.predictor(temperature=1.0)
    nll = []
    for batch in batches:
        pred = predictor.predict(batch.model_input())
        nll.append(pred.nll(batch.require_labels("the validation search")).double().cpu())
    return torch.cat(nll)


def choose(grid: list[float], per_value: list[torch.Tensor], *, rule: str,
           prefer: str, paired: bool = False, ceiling: float | None = None) -> int:
    """Index of the chosen grid value (see the module docstring).

    ``paired``: the standard error of value v is that of the per-example differences
    ``nll(v) − nll(v*)`` (the same examples scored twice), which stays informative when
    the best value's own per-example NLL is ~0 (a perfectly classified split);
    ``ceiling``: values whose mean NLL exceeds it are never chosen.
    """
    means = torch.stack([v.mean() for v in per_value])
    if not torch.isfinite(means).any():
        raise BayesifyError("every value of the validation grid gave a non-finite NLL")
    means = torch.nan_to_num(means, nan=math.inf)
    best = int(means.argmin())
    if rule == "min":
        return best
    if rule != "one_se":
        raise BayesifyError(f"unknown validation rule {rule!r}; use 'min' or 'one_se'")
    n = math.sqrt(max(per_value[best].numel(), 1))
    if paired:
        se = torch.stack([(v - per_value[best]).std() / n for v in per_value])
    else:
        se = (per_value[best].std() / n).expand_as(means)
    within = means <= means[best] + torch.nan_to_num(se, nan=0.0)
    if ceiling is not None:
        within &= means <= ceiling
        within[best] = True
    order = sorted(torch.nonzero(within).flatten().tolist(), key=lambda i: grid[i])
    return order[-1] if prefer == "largest" else order[0]


def select_on_validation(
    bnn: BayesianModel,
    val_loader: Iterable,
    *,
    set_knob: Callable[[float], None],
    grid: tuple[float, float, int] | list[float],
    rule: str = "one_se",
    prefer: str = "largest",
    batch_fn: Any = None,
    name: str = "scale",
    no_worse_than_base: bool = True,
) -> dict[str, Any]:
    """Search ``grid`` for the knob by validation NLL; installs and returns the choice.

    ``no_worse_than_base``: values whose validation NLL exceeds the starting network's
    (the unwrapped base) are not chosen — the broadest posterior the split cannot tell
    from the best value, but never a worse clean validation NLL than the network the
    user started from (the best grid value is the fallback). The defaults' contract. Returns ``{name: value, f"{name}_grid": [...],
    f"{name}_val_nll": [...], "base_val_nll": ...}``.
    """
    values = log_grid(grid) if isinstance(grid, tuple) else list(grid)
    batches = list(iter_batches(val_loader, device=bnn.device, batch_fn=batch_fn))
    if not batches:
        raise BayesifyError("the validation loader produced no batches")
    per_value = []
    for value in values:
        set_knob(value)
        per_value.append(validation_nll(bnn, batches))
    ceiling = None
    if no_worse_than_base:
        ceiling = float(base_validation_nll(bnn, batches).mean())
    index = choose(values, per_value, rule=rule, prefer=prefer, ceiling=ceiling)
    set_knob(values[index])
    return {name: values[index], f"{name}_grid": values,
            f"{name}_val_nll": [float(v.mean()) for v in per_value], "base_val_nll": ceiling}


@torch.no_grad()
def base_validation_nll(bnn: BayesianModel, batches: list[Any]) -> torch.Tensor:
    """``[n]`` per-example validation NLL of the starting network (``bnn.unwrap()``)."""
    import torch.nn.functional as F

    from bayesify.core.batch import call_model
    from bayesify.core.outputs import logits_of

    base = bnn.unwrap().eval()
    out = []
    for batch in batches:
        labels = batch.require_labels("the validation search")
        logits = logits_of(call_model(base, batch.model_input())).float()
        out.append(F.cross_entropy(logits, labels, reduction="none").double().cpu())
    return torch.cat(out)
