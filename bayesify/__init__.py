"""bayesify: turn a pretrained PyTorch network into a Bayesian one in two lines.

>>> bnn = bayesify(model, method="ibnn")           # doctest: +SKIP
>>> result = fit(bnn, train_loader, epochs=5)      # doctest: +SKIP
>>> bnn.predictor()(x).epistemic                   # doctest: +SKIP
"""

from bayesify.core.config import MethodConfig
from bayesify.core.factory import bayesify
from bayesify.core.fitting import FitContext, Knob, Step
from bayesify.core.layers import BayesianLayer
from bayesify.core.model import BayesianModel
from bayesify.core.registry import get_method_class, list_methods, register_method
from bayesify.errors import BayesifyError, NonFiniteLossError
from bayesify.persistence import load_posterior
from bayesify.predict import BasePredictor, EnsemblePredictor, ModelPredictor, Prediction
from bayesify.train import fit
from bayesify.train.loss import LossTerms, elbo_loss
from bayesify.train.tuning import tune
from bayesify.version import __version__


def describe_method(method: str) -> list[tuple[str, object, str]]:
    """``(option, default, help)`` for every config field of ``method``."""
    return get_method_class(method).config_cls.describe()


__all__ = [
    "BasePredictor",
    "BayesianLayer",
    "BayesianModel",
    "BayesifyError",
    "EnsemblePredictor",
    "FitContext",
    "Knob",
    "LossTerms",
    "MethodConfig",
    "ModelPredictor",
    "NonFiniteLossError",
    "Prediction",
    "Step",
    "__version__",
    "bayesify",
    "describe_method",
    "elbo_loss",
    "fit",
    "get_method_class",
    "list_methods",
    "load_posterior",
    "register_method",
    "tune",
]
