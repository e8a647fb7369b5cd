"""iBNN: implicit BNN with multiplicative node noise (Trinh, Kaski, Heinonen 2022)."""

from bayesify.methods.ibnn.config import IBNNConfig
from bayesify.methods.ibnn.layers import NodeNoiseLayer
from bayesify.methods.ibnn.method import IBNNMethod

__all__ = ["IBNNConfig", "IBNNMethod", "NodeNoiseLayer"]
