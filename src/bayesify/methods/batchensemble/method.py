"""batchensemble family: deterministic rank-1 fast weights per member (Wen et al. 2020)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.fitting import Step
from bayesify.core.method import wrapper_table
from bayesify.kit.knobs import MemberTemperature
from bayesify.kit.rank_one import RankOneLayer, RankOneTiledMethod, network_state
from bayesify.kit.steps import ElboStep, Tiled
from bayesify.methods.batchensemble.config import BatchEnsembleConfig

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


class BatchEnsembleLayer(RankOneLayer):
    """``W_k = W ∘ (s_k r_kᵀ)`` with point-estimate fast weights (no KL)."""

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext,
                 config: BatchEnsembleConfig) -> None:
        super().__init__(
            base_layer, context=context, components=config.components, init=config.init,
            sign_prob=config.sign_prob, init_mean_std=config.init_std,
            member_bias=config.member_bias, stochastic=False,
        )


class BatchEnsembleMethod(MemberTemperature, RankOneTiledMethod):
    """K deterministic members sharing the base weights; one tiled forward per batch.

    Knob: ``member_temperature``, a temperature of every member's logits chosen on
    validation data (bounded grid) when ``fit`` gets a ``val_loader``.
    """

    name = "batchensemble"
    config_cls = BatchEnsembleConfig
    wrappers: ClassVar = wrapper_table(BatchEnsembleLayer)

    def step(self) -> Step:
        # lr: r, s are O(1) multipliers; the mean loss over K tiled
        # copies gives each member 1/K of its gradient, so the step is scaled by K
        # clip_grad_norm 1: the factors are O(1) but their gradient is not — it scales with
        # the logits (×20 logits: gradient ×20, so one step at this lr multiplied channels
        # by 5 and the loss reached 1e20 in 3 steps: rank1's KL 6.6e29, batchensemble's
        # NaN NLL with KL 0, iBNN's NaN). Bounding the step's norm keeps the step size
        # the lr promises whatever the network's logit scale; it rarely binds otherwise.
        # lr_schedule cosine: at this lr the factors still move ~10 % a step at the end of a
        # constant-rate run, and without a validation split nothing picks a good state: the
        # last iterate of a depthwise BN CNN swung 0.85–0.92 between epochs and ended 2.7
        # points below its start (issue 30); annealed to 0, it ended 6 points above.
        step = ElboStep(Tiled(self.components), lr=0.05 * self.components,
                        groups=self.param_groups,
                        defaults={"clip_grad_norm": 1.0, "lr_schedule": "cosine"})
        step.network_state = network_state  # the start as the network itself
        return step

    def param_groups(self, bnn: BayesianModel, *, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """Fast weights at ``lr · fast_lr_mult``; biases / per-member BN at ``lr``."""
        fast_ids: set[int] = set()
        for layer in bnn.bayesian_layers().values():
            if isinstance(layer, RankOneLayer):
                fast_ids.update(id(p) for p in layer.fast_weights())
        params = [p for p in bnn.posterior_parameters() if p.requires_grad]
        fast = [p for p in params if id(p) in fast_ids]
        rest = [p for p in params if id(p) not in fast_ids]
        groups = [{"params": fast, "lr": lr * self.config.fast_lr_mult,
                   "weight_decay": weight_decay, "name": "fast_weights"}]
        if rest:
            groups.append({"params": rest, "lr": lr, "weight_decay": weight_decay, "name": "posterior"})
        return groups
