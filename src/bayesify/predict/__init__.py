"""Ensemble prediction over posterior members."""

from bayesify.core.prediction import Prediction
from bayesify.predict.mixture import MixturePredictor
from bayesify.predict.predictor import BasePredictor, EnsemblePredictor, ModelPredictor

__all__ = ["BasePredictor", "EnsemblePredictor", "MixturePredictor", "ModelPredictor",
           "Prediction"]
