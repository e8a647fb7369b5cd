"""Laplace around the pretrained MAP: last-layer kron/diag/full, subnetwork diagonal."""

from bayesify.methods.laplace.config import LaplaceConfig
from bayesify.methods.laplace.layers import LaplaceLayer
from bayesify.methods.laplace.method import LaplaceMethod

__all__ = ["LaplaceConfig", "LaplaceLayer", "LaplaceMethod"]

