"""Structure shared by the batch-tiled ensemble families (rank1, batchensemble, ensemble).

Training tiles the batch K times so that every member sees every example
(:class:`~bayesify.kit.steps.Tiled`: row r of the tiled batch is example ``r % B`` of
member ``r // B``); prediction tiles K members × n samples. BatchNorm is shared (the
frozen pretrained BN, the cheap approximation) or one BN per member
(``per_member_bn=True``).
"""

from __future__ import annotations

from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.kit.family import NoiseFamily, add_modules
from bayesify.kit.member_bn import member_batchnorm_wrappers


class TiledMethod(NoiseFamily):
    """A family whose K members each see the whole batch (component = row // B)."""

    def build(self, model: nn.Module, targets: list[str],
              context: SamplingContext) -> dict[str, nn.Module]:
        """The target wrappers, plus per-member BatchNorm (initialised from the
        pretrained BN) when configured."""
        modules = super().build(model, targets, context)
        if getattr(self.config, "per_member_bn", False):
            extra = dict(member_batchnorm_wrappers(model, context, self.components, targets))
            modules = add_modules(modules, extra, family=self.name)
        return modules
