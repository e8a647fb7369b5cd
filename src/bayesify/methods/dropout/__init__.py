"""dropout: Monte-Carlo dropout (Gal & Ghahramani 2016)."""

from bayesify.methods.dropout.config import DropoutConfig
from bayesify.methods.dropout.layers import DropoutLayer
from bayesify.methods.dropout.method import DropoutMethod

__all__ = ["DropoutConfig", "DropoutLayer", "DropoutMethod"]
