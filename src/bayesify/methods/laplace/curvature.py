"""Curvature backend: GGN of softmax cross-entropy, batch contributions (laplace-torch's split).

The posterior classes (``posterior.py``) store and use the curvature; this module
only computes it. With logits f, probabilities p and the softmax Hessian
``Λ_n = diag(p_n) − p_n p_nᵀ``, the GGN is ``Σ_n J_nᵀ Λ_n J_n``. For the last
Linear layer ``J_n = I_C ⊗ ã_nᵀ`` (ã = [a, 1]), so everything follows from the
features ã captured by the wrapper's forward and p: no second forward, no backward.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from bayesify.core.outputs import logits_of


def augmented_features(a: torch.Tensor, bias: bool) -> torch.Tensor:
    """``[B, D] → [B, D']``: ã = [a, 1] when the layer has a bias."""
    if not bias:
        return a
    return torch.cat([a, torch.ones_like(a[:, :1])], dim=1)


def kron_factors(feats: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch sums ``A = Σ ã ãᵀ [D', D']`` and ``G = Σ Λ_n = diag(Σ p) − pᵀp [C, C]``."""
    return feats.T @ feats, torch.diag(probs.sum(0)) - probs.T @ probs


def last_layer_diag(feats: torch.Tensor, probs: torch.Tensor, bias: bool) -> torch.Tensor:
    """Batch sum of diag GGN ``[P]`` in (weight [C, D] row-major, bias [C]) order.

    ``diag(Λ_n ⊗ ã ãᵀ)[c, d] = p_c (1 − p_c) ã_d²``.
    """
    lam = probs * (1 - probs)  # [B, C]
    d = feats.shape[1] - int(bias)
    weight = lam.T @ feats[:, :d].square()  # [C, D]
    parts = [weight.reshape(-1)]
    if bias:
        parts.append(lam.sum(0))
    return torch.cat(parts)


def last_layer_full(feats: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Batch sum ``Σ_n Λ_n ⊗ ã_n ã_nᵀ`` ``[P, P]`` over θ = vec([W | b]) (row-major).

    = blockdiag_c(Σ_n p_nc ã ãᵀ) − UᵀU with U_n = p_n ⊗ ã_n.
    """
    b, c = probs.shape
    d = feats.shape[1]
    blocks = torch.einsum("bc,bd,be->cde", probs, feats, feats)  # [C, D', D']
    u = (probs.unsqueeze(2) * feats.unsqueeze(1)).reshape(b, c * d)
    full = -(u.T @ u)
    full.view(c, d, c, d).diagonal(dim1=0, dim2=2).add_(blocks.permute(1, 2, 0))
    return full


def features_curvature(feats: torch.Tensor, classes: int, structure: str, bias: bool,
                       precision: float) -> tuple[torch.Tensor, ...]:
    """A batch's curvature of a Gaussian likelihood on the logits, ``Λ_n = s·I`` (``s`` =
    ``precision``): ``Σ_n s·I_C ⊗ ã_n ã_nᵀ`` in the layout of ``structure`` — ``kron``:
    ``(A, G)`` with ``G = s·B·I`` (exact: the curvature is a Kronecker product), ``diag``:
    ``[P]`` (weight row-major, then bias), ``full``: ``[P, P]``. It weighs every example
    alike, where the softmax GGN weighs each by ``p(1 − p)``."""
    a = feats.T @ feats
    if structure == "kron":
        b = feats.shape[0]
        return a, precision * b * torch.eye(classes, dtype=feats.dtype, device=feats.device)
    if structure == "diag":
        d = feats.shape[1] - int(bias)
        sq = feats.square().sum(0) * precision  # [D']
        parts = [sq[:d].repeat(classes)]
        if bias:
            parts.append(sq[d:].repeat(classes))
        return (torch.cat(parts),)
    eye = torch.eye(classes, dtype=feats.dtype, device=feats.device)
    return (precision * torch.kron(eye, a),)


def subnetwork_parameters(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Detached MAP values of the subnetwork (functional_call keys)."""
    return {n: model.get_parameter(n).detach() for n in names}


def example_chunks(x: torch.Tensor, per_chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    for start in range(0, x.shape[0], per_chunk):
        yield start, x[start:start + per_chunk]


def per_example_jacobians(
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``J [B, C, P]`` (∂f_c/∂θ per example, θ = concatenated ``params``) and ``f [B, C]``.

    ``vmap`` over examples of ``jacrev`` of a batch-of-one forward (BatchNorm must be
    in eval mode); works under an outer ``torch.no_grad`` (torch.func ignores it).
    """
    def single(p: dict[str, torch.Tensor], x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = logits_of(functional_call(model, p, (x1.unsqueeze(0),))).squeeze(0)
        return out, out

    jac, f = vmap(jacrev(single, has_aux=True), in_dims=(None, 0))(params, x)
    b, c = f.shape
    return torch.cat([jac[n].reshape(b, c, -1) for n in params], dim=2), f


def ggn_diag_from_jacobians(jac: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``Σ_n diag(J_nᵀ Λ_n J_n) [P] = Σ_n [Σ_c p_c J_cp² − (Σ_c p_c J_cp)²]`` (no [B, C, C])."""
    weighted = probs.unsqueeze(2) * jac
    return (weighted * jac).sum((0, 1)) - weighted.sum(1).square().sum(0)


def fisher_diag_sampled(
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, probs: torch.Tensor,
    *, samples: int, generator: torch.Generator | None = None,
) -> torch.Tensor:
    """MC estimate of the GGN diagonal ``[P]``: mean over y ~ Cat(p) of per-example ``g²``.

    For softmax cross-entropy ``E_y[∇ℓ ∇ℓᵀ] = Jᵀ Λ J``, so this is unbiased for the GGN
    at the cost of one backward per sample instead of C.
    """
    def loss(p: dict[str, torch.Tensor], x1: torch.Tensor, y1: torch.Tensor) -> torch.Tensor:
        out = logits_of(functional_call(model, p, (x1.unsqueeze(0),)))
        return F.cross_entropy(out, y1.unsqueeze(0))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    total = None
    for _ in range(samples):
        y = torch.multinomial(probs.float(), 1, generator=generator).squeeze(1).to(x.device)
        g = per_example(params, x, y)
        sq = torch.cat([g[n].reshape(x.shape[0], -1) for n in params], 1).square().sum(0)
        total = sq if total is None else total + sq
    return total / samples
