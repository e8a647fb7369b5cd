"""Bases shared by several families: frozen-noise export and extra modules.

``NoiseFamily`` exports as a copy of the network whose layers read frozen per-member
noise tables (:mod:`bayesify.kit.frozen_noise`), seeded exactly as at prediction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from bayesify.core.method import Method
from bayesify.errors import BayesifyError
from bayesify.kit.frozen_noise import frozen_noise_members

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def add_modules(modules: dict[str, nn.Module], extra: dict[str, nn.Module], *,
                family: str) -> dict[str, nn.Module]:
    """``modules`` plus ``extra`` (e.g. per-member BatchNorm); a name in both is an error."""
    clash = sorted(set(extra) & set(modules))
    if clash:
        raise BayesifyError(f"method {family!r} would wrap {clash[:3]} twice")
    return {**modules, **extra}


class NoiseFamily(Method):
    """A family predicting with the default ``Method.member_logits`` (M networks whose
    layers draw their noise through ``SamplingContext.draw``)."""

    def export_module(self, bnn: BayesianModel, *, samples_per_component: int, seed: int,
                      example_input: Any) -> nn.Module:
        """A frozen-noise copy of the network: ``x [B, ...] → member logits [M, B, C]``."""
        return frozen_noise_members(bnn, samples_per_component=samples_per_component, seed=seed,
                                    example_input=example_input)
