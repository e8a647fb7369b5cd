"""Evaluation protocol: corruptions, OOD scoring, adversarial robustness."""

from bayesify.evaluation.corruptions import gaussian_mix

__all__ = ["gaussian_mix"]
