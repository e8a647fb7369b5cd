"""Batch layout shared by the batch-tiled ensemble families (rank1, batchensemble, ensemble).

Training tiles the batch K times so that every member sees every example
(row r of the tiled batch is example ``r % B`` of member ``r // B``); prediction
tiles K members × n samples. BatchNorm is shared (the frozen pretrained BN, the
cheap approximation) or one BN per member (``per_member_bn=True``).
"""

from __future__ import annotations

import torch
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer
from bayesify.kit.family import NoiseFamily
from bayesify.kit.member_bn import member_batchnorm_wrappers


class TiledMethod(NoiseFamily):
    """A family whose K members each see the whole batch (component = row // B)."""

    def train_components(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """``[K·B]`` component of every row: ``row // B`` (the batch tiled K times)."""
        return torch.arange(self.components * batch_size, device=device) // batch_size

    def extra_wrappers(self, model: nn.Module, context: SamplingContext,
                       targets: list[str]) -> dict[str, BayesianLayer]:
        """Per-member BatchNorm (initialised from the pretrained BN) when configured."""
        if getattr(self.config, "per_member_bn", False):
            return dict(member_batchnorm_wrappers(model, context, self.components, targets))
        return {}
