"""epinet: an index-conditioned add-on with a fixed prior network (Osband et al., NeurIPS 2023)."""

from bayesify.methods.epinet.config import EpinetConfig
from bayesify.methods.epinet.layers import EpinetLayer
from bayesify.methods.epinet.method import EpinetMethod

__all__ = ["EpinetConfig", "EpinetLayer", "EpinetMethod"]
