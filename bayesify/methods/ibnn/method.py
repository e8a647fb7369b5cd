"""iBNN family: registry entry, type → wrapper table, training/prediction layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from bayesify.core.method import Method, wrapper_table
from bayesify.core.predictive_scale import SPREAD_GRID, add_knob, reset_knob, tune_knob
from bayesify.methods.ibnn.config import IBNNConfig
from bayesify.methods.ibnn.layers import NodeNoiseLayer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

KNOB = "ibnn_noise_scale"


class IBNNMethod(Method):
    """Multiplicative node noise with a K-component mixture posterior.

    Training (Algorithm 1): every example repeated ``samples`` times, rows dealt
    to components round-robin (inherited default). Prediction: every component
    with ``predict_samples`` draws, averaged in probability space.
    """

    name = "ibnn"
    config_cls = IBNNConfig
    wrappers: ClassVar = wrapper_table(NodeNoiseLayer, transposed=True)

    def prepare(self, bnn: BayesianModel) -> None:
        add_knob(bnn, KNOB, layers=bnn.bayesian_layers().values())

    def begin_fit(self, bnn: BayesianModel, *, steps_per_epoch: int, epochs: int) -> None:
        reset_knob(bnn, KNOB)

    def finish_fit(self, bnn: BayesianModel, *, train_loader: Any, val_loader: Any, ctx: Any,
                   batch_fn: Any = None) -> dict[str, Any]:
        """With ``val_loader``: the multiplier of the learned noise stds (0 = the K
        component means) by validation NLL (shared one-SE search)."""
        return tune_knob(bnn, val_loader, name=KNOB, grid=SPREAD_GRID, batch_fn=batch_fn,
                         meaning="multiplier of the learned node-noise std; 0 = component means")

    def default_lr(self) -> float:
        # the paper's variational LR for pretrained ResNet-50 (large, constant, no
        # weight decay): the means and ρ are O(1) multipliers whatever the network, so
        # one step size fits every network
        return 0.2
