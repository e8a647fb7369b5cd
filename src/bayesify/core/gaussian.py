"""Links of a Gaussian predictive over the logits (probit, Laplace bridge): what
:class:`~bayesify.core.prediction.Prediction` applies last."""

from __future__ import annotations

import math

import torch


def probit_log_probs(logits: torch.Tensor, var_diag: torch.Tensor) -> torch.Tensor:
    """``log softmax(f / sqrt(1 + π/8 · diag Σ_f))`` ``[B, C]``."""
    return torch.log_softmax(logits / torch.sqrt(1.0 + math.pi / 8.0 * var_diag), dim=-1)


def bridge_log_probs(logits: torch.Tensor, fvar: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Laplace bridge (Hobbhahn et al.) as in laplace-torch: log of the Dirichlet mean α/Σα.

    Zero-mean correction with ``Σ_f 1`` and ``1ᵀ Σ_f 1`` only (no ``[B, C, C]``)::

        μ = f − (Σ_f 1)(1ᵀ f)/(1ᵀ Σ_f 1),   v = diag Σ_f − (Σ_f 1)²/(1ᵀ Σ_f 1)
        α_c = (1 − 2/C + e^{μ_c} Σ_l e^{−μ_l} / C²) / v_c
    """
    diag, rowsum, total = fvar
    dtype = logits.dtype
    f, diag, rowsum, total = (t.double() for t in (logits, diag, rowsum, total))
    c = f.shape[-1]
    mu = f - rowsum * f.sum(-1, keepdim=True) / total.unsqueeze(-1)
    var = diag - rowsum.square() / total.unsqueeze(-1)
    cross = torch.exp(mu + torch.logsumexp(-mu, dim=-1, keepdim=True))
    alpha = (1 - 2 / c + cross / c**2) / var
    probs = torch.nan_to_num(alpha / alpha.sum(-1, keepdim=True), nan=1.0 / c)
    return probs.clamp_min(torch.finfo(torch.float64).tiny).log().to(dtype)
