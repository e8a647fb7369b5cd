"""Evaluation protocol: corruptions, OOD scoring, adversarial robustness, reports."""

from bayesify.evaluation.adversarial import (
    differentiable_member_logits,
    fgsm,
    fgsm_sweep,
    input_gradient,
)
from bayesify.evaluation.corruptions import (
    CORRUPTIONS,
    DEFAULT_SWEEPS,
    corrupt,
    corrupted_loader,
    gaussian_mix,
    rotate,
    salt_and_pepper,
    sweep_loaders,
)
from bayesify.evaluation.report import TABLE_KEYS, report
from bayesify.evaluation.scoring import (
    bootstrap_se,
    corruption_sweep,
    ood_scores,
    predictive_statistics,
    summarize,
)

__all__ = [
    "CORRUPTIONS",
    "DEFAULT_SWEEPS",
    "TABLE_KEYS",
    "bootstrap_se",
    "corrupt",
    "corrupted_loader",
    "corruption_sweep",
    "differentiable_member_logits",
    "fgsm",
    "fgsm_sweep",
    "gaussian_mix",
    "input_gradient",
    "ood_scores",
    "predictive_statistics",
    "report",
    "rotate",
    "salt_and_pepper",
    "summarize",
    "sweep_loaders",
]
