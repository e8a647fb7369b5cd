"""FGSM on the ensemble's predictive mean.

The attack perturbs the input along the sign of the gradient of the NLL of the
*mixture* predictive, ``L(x) = −log (1/M) Σ_m softmax(f_m(x) / T)_y``, back-propagated
through every member at once (Goodfellow et al.'s fast gradient sign method applied
to the Bayesian model average, not to one sampled network):

    x_adv = clip(x + ε · sign(∇_x L(x)), lo, hi)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from bayesify import metrics
from bayesify.core.prediction import Prediction
from bayesify.errors import BayesifyError
from bayesify.predict.predictor import BasePredictor, EnsemblePredictor, ModelPredictor


def differentiable_member_logits(predictor: BasePredictor, x: torch.Tensor) -> torch.Tensor:
    """``[M, B, C]`` member logits with a gradient path to ``x`` (untempered: the
    predictor's temperature acts on the predictive, see :func:`input_gradient`).

    The predictors' own ``member_logits`` run under ``no_grad``; this evaluates the
    *same* M networks with autograd on: for a :class:`BayesianModel` its
    ``member_logits`` with the predictor's fixed seed and sample count (so the
    attacked members are exactly the evaluated ones), for a :class:`ModelPredictor`
    every model in eval mode. Other predictors may provide a
    ``differentiable_member_logits(x)`` method; otherwise their ``member_logits``
    is tried under ``enable_grad`` and rejected if it returns no graph.
    """
    from bayesify.core.outputs import logits_of

    hook = getattr(predictor, "differentiable_member_logits", None)
    with torch.enable_grad():
        if callable(hook):
            logits = hook(x)
        elif isinstance(predictor, EnsemblePredictor):
            bnn = predictor.bnn
            was_training = bnn.training
            bnn.eval()
            try:
                logits = bnn.member_logits(
                    x, samples_per_component=predictor.samples_per_component,
                    max_rows=predictor.max_rows, seed=predictor.seed,
                )
            finally:
                bnn.train(was_training)
        elif isinstance(predictor, ModelPredictor):
            outs = []
            for model in predictor.models:
                was_training = model.training
                model.eval()
                try:
                    outs.append(logits_of(model(x)).float())
                finally:
                    model.train(was_training)
            logits = torch.stack(outs)
        else:
            logits = predictor.member_logits(x)
    if not logits.requires_grad:
        raise BayesifyError(
            f"{type(predictor).__name__} gives member logits without a gradient path to the "
            "input; give it a differentiable_member_logits(x) method to attack it with FGSM"
        )
    return logits.float()


def input_gradient(predictor: BasePredictor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``∇_x Σ_b −log p_T(y_b | x_b)`` of the tempered mixture predictive, shape of ``x``."""
    x = x.detach().clone().requires_grad_(True)
    logits = differentiable_member_logits(predictor, x)
    log_probs = Prediction(logits).scaled(predictor.temperature).log_probs
    loss = metrics.per_example_nll(log_probs, y.to(logits.device)).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return grad


def fgsm(
    predictor: BasePredictor,
    x: torch.Tensor,
    y: torch.Tensor,
    epsilon: float,
    *,
    clamp: tuple[float, float] | None = (0.0, 1.0),
) -> torch.Tensor:
    """Adversarial inputs ``clip(x + ε·sign(∇_x L), lo, hi)`` against the mixture NLL."""
    if epsilon < 0:
        raise BayesifyError(f"epsilon must be >= 0, got {epsilon}")
    x = x.to(predictor.device)
    return _perturb(x, input_gradient(predictor, x, y).sign(), epsilon, clamp)


def _perturb(
    x: torch.Tensor, direction: torch.Tensor, epsilon: float, clamp: tuple[float, float] | None
) -> torch.Tensor:
    x_adv = x.detach() + epsilon * direction
    return x_adv.clamp(*clamp) if clamp is not None else x_adv


def fgsm_sweep(
    predictor: BasePredictor,
    loader: Iterable,
    epsilons: Sequence[float],
    *,
    clamp: tuple[float, float] | None = (0.0, 1.0),
) -> list[dict[str, Any]]:
    """Accuracy, NLL and entropy = aleatoric + epistemic of FGSM inputs, one row per ε.

    The input gradient is computed once per batch and reused for every ε (FGSM is
    a single step, so the direction does not depend on ε).
    """
    sums: dict[float, dict[str, float]] = {
        float(e): dict.fromkeys(("correct", "nll", "entropy", "aleatoric", "epistemic"), 0.0)
        for e in epsilons
    }
    count = 0
    for batch in loader:
        x, y = batch[0].to(predictor.device), batch[1].to(predictor.device)
        direction = input_gradient(predictor, x, y).sign()
        for eps, acc in sums.items():
            with torch.no_grad():
                pred = predictor.predict(
                    _perturb(x, direction, eps, clamp)).scaled(predictor.temperature)
            acc["correct"] += (pred.argmax() == y).float().sum().item()
            acc["nll"] += metrics.per_example_nll(pred.log_probs, y).sum().item()
            acc["entropy"] += pred.entropy.sum().item()
            acc["aleatoric"] += pred.aleatoric.sum().item()
            acc["epistemic"] += pred.epistemic.sum().item()
        count += x.shape[0]
    if count == 0:
        raise BayesifyError("fgsm_sweep: the loader produced no batches")
    return [
        {"epsilon": eps, "accuracy": acc["correct"] / count, "nll": acc["nll"] / count,
         "entropy": acc["entropy"] / count, "aleatoric": acc["aleatoric"] / count,
         "epistemic": acc["epistemic"] / count}
        for eps, acc in sums.items()
    ]
