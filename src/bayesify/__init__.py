"""bayesify: turn a pretrained PyTorch network into a Bayesian one in two lines.

>>> bnn = bayesify(model, method="ibnn")           # doctest: +SKIP
>>> result = fit(bnn, train_loader)                # doctest: +SKIP
>>> bnn.predictor()(x).epistemic                   # doctest: +SKIP

Every spelling works (:mod:`bayesify.entry`): ``import bayesify as bz;
bz.bayesify(model)``, ``import bayesify; bayesify(model)`` (the package is
callable) and ``from bayesify import bayesify; bayesify(model)`` with
``bayesify.fit``, ``bayesify.load_posterior``, ``bayesify.elbo_loss``, ... on it.
"""

import sys as _sys

from bayesify.core.config import MethodConfig
from bayesify.core.factory import bayesify as _factory
from bayesify.core.fitting import FitContext, Knob, Step
from bayesify.core.layers import BayesianLayer
from bayesify.core.model import BayesianModel
from bayesify.core.registry import get_method_class, list_methods, register_method
from bayesify.errors import BayesifyError, ModelOutputError, NonFiniteLossError
from bayesify.persistence import load_posterior
from bayesify.predict import (
    BasePredictor,
    EnsemblePredictor,
    MixturePredictor,
    ModelPredictor,
    Prediction,
)
from bayesify.train import fit
from bayesify.train.best import starting_state
from bayesify.train.custom_loop import (
    GuardedStep,
    param_groups,
    posterior_lr,
    posterior_optimizer,
)
from bayesify.train.loss import LossTerms, elbo_loss
from bayesify.train.tuning import tune
from bayesify.version import __version__


def describe_method(method: str) -> list[tuple[str, object, str]]:
    """``(option, default, help)`` for every config field of ``method``."""
    return get_method_class(method).config_cls.describe()


def method_summary(method: str) -> str:
    """One line saying what family ``method`` is (its config class's docstring)."""
    from bayesify.entry import first_doc_line

    return first_doc_line(get_method_class(method).config_cls)


__all__ = [
    "BasePredictor",
    "BayesianLayer",
    "BayesianModel",
    "BayesifyError",
    "EnsemblePredictor",
    "FitContext",
    "GuardedStep",
    "Knob",
    "LossTerms",
    "MethodConfig",
    "MixturePredictor",
    "ModelOutputError",
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
    "method_summary",
    "param_groups",
    "posterior_lr",
    "posterior_optimizer",
    "register_method",
    "starting_state",
    "tune",
]

from bayesify.entry import BayesifyEntry as _Entry
from bayesify.entry import CallablePackage as _CallablePackage

#: the factory, carrying the package's public names (``bayesify.fit`` after
#: ``from bayesify import bayesify``)
bayesify = _Entry(_factory, _sys.modules[__name__])
_sys.modules[__name__].__class__ = _CallablePackage  # ``import bayesify; bayesify(model)``
