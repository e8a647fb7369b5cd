"""rank1: rank-1 Bayesian neural networks (Dusenberry et al. 2020)."""

from bayesify.kit.rank_one import RankOneLayer
from bayesify.methods.rank1.config import Rank1Config
from bayesify.methods.rank1.method import Rank1Layer, Rank1Method

__all__ = ["Rank1Config", "Rank1Layer", "Rank1Method", "RankOneLayer"]
