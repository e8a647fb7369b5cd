"""ensemble: deep ensembles and snapshot ensembles behind the shared predictor."""

from bayesify.methods.ensemble.config import EnsembleConfig
from bayesify.methods.ensemble.layers import EnsembleLayer
from bayesify.methods.ensemble.method import EnsembleMethod

__all__ = ["EnsembleConfig", "EnsembleLayer", "EnsembleMethod"]
