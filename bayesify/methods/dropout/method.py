"""dropout family: MC dropout (Gal & Ghahramani 2016) behind the shared predictor."""

from __future__ import annotations

from typing import Any, ClassVar

from bayesify.core.method import Method, wrapper_table
from bayesify.methods.dropout.config import DropoutConfig
from bayesify.methods.dropout.layers import DropoutLayer


class DropoutMethod(Method):
    """Dropout before every target layer, kept on at prediction; no KL term.

    One component; training draws one mask per row (``samples`` repeats per
    example), prediction evaluates ``predict_samples`` fixed masks. Under
    ``deterministic()`` dropout is off (the weight-scaling approximation).
    """

    name = "dropout"
    config_cls = DropoutConfig
    wrappers: ClassVar = wrapper_table(DropoutLayer)

    def default_lr(self) -> float:
        return 0.001  # the variational parameters are the pretrained weights: fine-tuning LR

    @classmethod
    def demo_recipe(cls) -> dict[str, Any]:
        return {
            "options": {"p": 0.1},
            "fit": {"epochs": 10, "lr": 0.001},
            "predictor": {"samples_per_component": 16},
        }
