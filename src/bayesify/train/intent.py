"""What the user froze stays frozen: the base parameters ``base_lr > 0`` may train.

``bayesify()`` records every base parameter's ``requires_grad`` before it freezes
the base. ``fit(base_lr > 0)`` unfreezes exactly the parameters that were
trainable then: a parameter the user froze on purpose (an embedding, a backbone
stage) is never trained. With every base parameter frozen by the user,
``base_lr > 0`` cannot be honoured and is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

__all__ = ["trainable_base_parameters"]


def trainable_base_parameters(bnn: BayesianModel) -> list[nn.Parameter]:
    """Set ``requires_grad`` on the base parameters the user left trainable (and off on
    the others); returns them. Raises when the user froze all of them."""
    recorded = getattr(bnn, "_base_requires_grad", {})
    chosen, frozen = [], []
    for name, p in bnn.named_base_parameters():
        keep = recorded.get(name, True)
        p.requires_grad_(keep)
        (chosen if keep else frozen).append(p)
    if frozen and not chosen:
        raise BayesifyError(
            f"fit(base_lr > 0) would train the base network, but all {len(frozen)} of its "
            "parameters had requires_grad=False when it was bayesified (frozen by you); "
            "unfreeze the ones to fine-tune before bayesify(), or use base_lr=0")
    return chosen
