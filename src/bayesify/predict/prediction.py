"""``Prediction`` lives in :mod:`bayesify.core.prediction` (families build it); re-exported here."""

from bayesify.core.prediction import GAUSSIAN_SAMPLES, Prediction

__all__ = ["GAUSSIAN_SAMPLES", "Prediction"]
