"""batchensemble family: deterministic rank-1 fast weights per member (Wen et al. 2020)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.method import wrapper_table
from bayesify.core.rank_one import RankOneLayer
from bayesify.core.tiled import TiledMethod
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


class BatchEnsembleMethod(TiledMethod):
    """K deterministic members sharing the base weights; one tiled forward per batch."""

    name = "batchensemble"
    config_cls = BatchEnsembleConfig
    wrappers: ClassVar = wrapper_table(BatchEnsembleLayer)

    def default_samples_per_component(self) -> int:
        return 1  # members are deterministic: more samples would repeat them

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

    def default_lr(self) -> float:
        return 0.05 * self.components

    @classmethod
    def demo_recipe(cls) -> dict[str, Any]:
        return {
            # paper init N(1, 0.5²) for diversity; short, slow-fast-weight fine-tune
            "options": {"components": 4, "init": "normal", "init_std": 0.5, "fast_lr_mult": 0.25},
            "fit": {"epochs": 5, "lr": 0.1},
            "predictor": {"samples_per_component": 1},
        }
