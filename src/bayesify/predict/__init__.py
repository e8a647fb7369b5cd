"""Ensemble prediction over posterior members."""

from bayesify.core.prediction import Prediction
from bayesify.predict.predictor import BasePredictor, EnsemblePredictor, ModelPredictor

__all__ = ["BasePredictor", "EnsemblePredictor", "ModelPredictor", "Prediction"]
