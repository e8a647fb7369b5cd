"""abnn: Bayesian normalisation layers on a pretrained network (Franchi et al., CVPR 2024)."""

from bayesify.methods.abnn.config import ABNNConfig
from bayesify.methods.abnn.layers import BayesNormLayer
from bayesify.methods.abnn.method import ABNNMethod

__all__ = ["ABNNConfig", "ABNNMethod", "BayesNormLayer"]
