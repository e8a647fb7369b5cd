"""SWAG: SWA / SWAG-diagonal / SWAG around the pretrained weights (Maddox et al. 2019)."""

from bayesify.methods.swag.config import SWAGConfig
from bayesify.methods.swag.layers import SWAGLayer, SWAGMoments
from bayesify.methods.swag.method import SWAGMethod

__all__ = ["SWAGConfig", "SWAGLayer", "SWAGMethod", "SWAGMoments"]
