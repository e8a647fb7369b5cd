"""``StackedModels``: plain networks as one ``inputs → [M, B, C]`` module (export)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from bayesify.core.outputs import logits_of


class StackedModels(nn.Module):
    """Plain networks (MAP, a deep ensemble, sampled members) as ``inputs → [M, B, C]``."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.models = nn.ModuleList(copy.deepcopy(m).eval() for m in models)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.stack([logits_of(m(*args, **kwargs)).float() for m in self.models])
