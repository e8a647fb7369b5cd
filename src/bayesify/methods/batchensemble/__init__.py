"""batchensemble: BatchEnsemble (Wen et al. 2020), the deterministic rank-1 ensemble."""

from bayesify.methods.batchensemble.config import BatchEnsembleConfig
from bayesify.methods.batchensemble.method import BatchEnsembleLayer, BatchEnsembleMethod

__all__ = ["BatchEnsembleConfig", "BatchEnsembleLayer", "BatchEnsembleMethod"]
