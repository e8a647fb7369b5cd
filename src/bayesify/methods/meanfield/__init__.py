"""Mean-field Gaussian weight posterior: Bayes by Backprop (Blundell et al. 2015)."""

from bayesify.kit.priors import WeightPrior, gaussian_kl, scale_mixture_log_prob
from bayesify.methods.meanfield.config import MeanFieldConfig
from bayesify.methods.meanfield.layers import MeanFieldLayer
from bayesify.methods.meanfield.method import (
    MeanFieldMethod,
    blundell_log_weight,
    minibatch_kl_weight,
)
from bayesify.methods.meanfield.pruning import PruneResult, magnitude_prune, snr_prune

__all__ = [
    "MeanFieldConfig",
    "MeanFieldLayer",
    "MeanFieldMethod",
    "PruneResult",
    "WeightPrior",
    "blundell_log_weight",
    "gaussian_kl",
    "magnitude_prune",
    "minibatch_kl_weight",
    "scale_mixture_log_prob",
    "snr_prune",
]
