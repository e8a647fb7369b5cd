"""``Prediction``: the mixture predictive and its uncertainty decomposition."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from bayesify import metrics


@dataclass(frozen=True)
class Prediction:
    """Predictive distribution of M members for a batch of B inputs.

    ``member_logits [M, B, C]`` (already divided by the temperature).
    """

    member_logits: torch.Tensor

    @cached_property
    def member_probs(self) -> torch.Tensor:
        """``[M, B, C]`` softmax of every member."""
        return self.member_logits.float().softmax(-1)

    @cached_property
    def log_probs(self) -> torch.Tensor:
        """``[B, C]`` log of the mixture mean (stable)."""
        return metrics.mixture_log_probs(self.member_logits)

    @cached_property
    def probs(self) -> torch.Tensor:
        """``[B, C]`` mixture mean, averaged in probability space."""
        return self.log_probs.exp()

    @cached_property
    def entropy(self) -> torch.Tensor:
        """``[B]`` total predictive entropy H(E_m p_m)."""
        return metrics.entropy(self.probs)

    @cached_property
    def aleatoric(self) -> torch.Tensor:
        """``[B]`` expected entropy E_m H(p_m)."""
        return metrics.expected_entropy(self.member_probs)

    @cached_property
    def epistemic(self) -> torch.Tensor:
        """``[B]`` mutual information (BALD) = entropy − aleatoric."""
        return (self.entropy - self.aleatoric).clamp_min(0)

    @cached_property
    def variation_ratio(self) -> torch.Tensor:
        return metrics.variation_ratio(self.member_probs)

    @cached_property
    def predictive_variance(self) -> torch.Tensor:
        """``[B, C]`` variance of the class probabilities across members."""
        return self.member_probs.var(0, unbiased=False)

    @property
    def num_members(self) -> int:
        return self.member_logits.shape[0]

    def argmax(self) -> torch.Tensor:
        return self.probs.argmax(-1)
