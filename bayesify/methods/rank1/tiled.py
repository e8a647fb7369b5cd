"""Batch layout shared by the batch-tiled ensemble families (rank1, batchensemble, ensemble).

Training tiles the batch K times so that every member sees every example
(row r of the tiled batch is example ``r % B`` of member ``r // B``); prediction
tiles K members × n samples. BatchNorm is shared (the frozen pretrained BN, the
cheap approximation) or one BN per member (``per_member_bn=True``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bayesify.core.member_bn import install_member_batchnorm
from bayesify.core.method import Method

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


class TiledMethod(Method):
    """A family whose K members each see the whole batch (component = row // B)."""

    def train_components(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """``[K·B]`` component of every row: ``row // B`` (the batch tiled K times)."""
        return torch.arange(self.components * batch_size, device=device) // batch_size

    def prepare(self, bnn: BayesianModel) -> None:
        """Per-member BatchNorm (initialised from the pretrained BN) when configured."""
        if getattr(self.config, "per_member_bn", False):
            install_member_batchnorm(bnn, self.components)
