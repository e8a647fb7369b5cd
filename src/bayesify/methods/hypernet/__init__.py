"""Bayes by Hypernet: implicit weight posteriors from generator MLPs (Pawlowski et al. 2017)."""

from bayesify.methods.hypernet.config import HypernetConfig
from bayesify.methods.hypernet.estimator import nearest_neighbour_kl
from bayesify.methods.hypernet.generator import NoiseSource, WeightGenerator
from bayesify.methods.hypernet.layers import HypernetLayer
from bayesify.methods.hypernet.method import HypernetMethod

__all__ = [
    "HypernetConfig",
    "HypernetLayer",
    "HypernetMethod",
    "NoiseSource",
    "WeightGenerator",
    "nearest_neighbour_kl",
]
