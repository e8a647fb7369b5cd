"""The KL part of MNF's auxiliary bound for one layer: the prior, q(W | z) and r(z | W).

Notation (one wrapped Linear/Conv, C input nodes, fan-out n per node)::

    w   [C, n]   the base layer's (pretrained) weights, node view (:func:`node_view`)
    z_T [C]      one sample of the node noise from the flow posterior q(z_T)
    q(W | z_T) = Π_ij N(W_ij; z_i w_ij, σ_ij²)                    (Gaussian around z ∘ w)

The bound (Louizos & Welling 2017; ``−KL(q(W)‖p(W))`` bounded with the auxiliary
inverse model ``r``)::

    L = E_q(z_T, W)[ log p(y|x, W) − KL(q(W|z_T) ‖ p(W)) + log r(z_T|W) − log q(z_T) ]

so the layer's KL term (what the trainer adds as ``KL/N_train``) is the single-sample
estimate ``KL(q(W|z_T)‖p(W)) + log q(z_T) − log r(z_T|W)``, ``z_T ~ q``, ``W ~ q(W|z_T)``,
with ``E log q(z_0)`` in closed form (the Gaussian's negative entropy).

**The prior, for a pretrained network** (design note). The paper's N(0, I) would pull
the pretrained weights to zero; a per-weight prior centred on them with a relative std
(meanfield's ``relative``) pins every node scale: shifting z_i moves n weights at once,
so its implied prior on z_i has std ``s/√n`` (0.004 for a 64×3×3 conv) and SGD on z
diverges at any step size that moves it. The prior here is MNF's own generative story
around the pretrained net — each node's fan-out weights rescaled by a common factor
plus per-weight jitter::

    W_i = t_i w_i + e_i,   t_i ~ N(1, s²),   e_ij ~ N(0, d_ij²),   d_ij = δ_p·max(|w_ij|, floor)
    ⇒ p(W_i) = N(w_i, D_i + s² w_i w_iᵀ)                             (rank one plus diagonal)

so the KL of q(W|z) is closed form through the matrix-determinant lemma and
Sherman–Morrison (:func:`node_prior_kl`, O(C·n)), its z part is ``(z_i − 1)²/(2(s² +
1/γ_i))`` ≈ iBNN's ``N(1, s²)`` prior on the node, and its σ part pulls σ_ij to ≈ d_ij.

**The inverse model** (eq. 11–12 of the paper, extended). The paper's r sees W only
through one global projection ``tanh(cᵀW)``::

    μ̃_i = m_i + b1_i·ḡ,   log σ̃_i = λ_i + b2_i·ḡ,   ḡ = mean_j tanh((cᵀW)_j)

(``m``, ``λ`` per-node offsets added so that r starts equal to q(z_0)). It cannot tell z_i
from W, so at best r ≈ q(z_T) and ``log q(z_T) − log r`` cancels the entropy of q(z): the
z part of the KL is then ``E (z−1)²/2s²`` alone and shrinks the node noise towards 0
(with the node statistic below it is ≈ ``KL(q(z)‖N(1, s²))``, which widens it towards s).
``inverse_model='node'`` (default) also uses each node's own
statistic ``a_i = ⟨W_i, w_i⟩/‖w_i‖²`` — under q(W|z) it is ``N(z_i, v_i)`` with
``v_i = Σ_j w_ij² σ_ij² / ‖w_i‖⁴`` — combined with the paper's Gaussian by precision
(the posterior of z_i given a_i under that Gaussian as prior)::

    r(z_b,i | W) = N(z_b,i; (π_i μ̃_i + a_i/v_i)/(π_i + 1/v_i), 1/(π_i + 1/v_i)),  π_i = σ̃_i⁻²

where ``z_b = f_r(z_T)`` is the output of r's own flow (``log r`` adds its
log-determinant). Both forms are valid auxiliary bounds; only their tightness differs.
W is sampled whole once per step (O(C·n), the cost of the KL itself): ``a`` and ``cᵀW``
are correlated through it, so sampling them as independent Gaussians would bias the bound.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bayesify.methods.mnf.flows import CouplingFlow

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def node_view(t: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """A Linear ``[out, in]`` or Conv ``[out, in/groups, *k]`` tensor → ``[in, fan_out]``.

    Row i holds every weight that reads input node i (its out channels within its group,
    times the kernel positions): what a multiplicative ``z_i`` scales.
    """
    out, per_group = t.shape[0], t.shape[1]
    blocks = t.reshape(groups, out // groups, per_group, -1)     # [g, O/g, I/g, K]
    return blocks.permute(0, 2, 1, 3).reshape(groups * per_group, -1)


def log_normal(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Elementwise ``log N(x; mean, var)``."""
    return -0.5 * (x - mean).pow(2) / var - 0.5 * torch.log(var) - _HALF_LOG_2PI


def prior_jitter(w: torch.Tensor, *, jitter: float, floor: float) -> torch.Tensor:
    """``d [C, n] = δ_p·max(|w|, floor)``: the prior's per-weight std."""
    return jitter * w.abs().clamp_min(floor)


def node_prior_kl(w: torch.Tensor, std: torch.Tensor, z: torch.Tensor, *, scale: float,
                  jitter: float, floor: float) -> torch.Tensor:
    """``KL(q(W|z) ‖ p(W))`` summed over the layer (closed form, fp32).

    ``w [C, n]`` pretrained weights, ``std [C, n]`` σ of q(W|z), ``z [C]``; the prior is
    ``N(w_i, D_i + s² w_i w_iᵀ)`` per node (module docstring). With ``γ = Σ_j w²/d²``::

        KL_i = ½[ Σ σ²/d² − s²/(1+s²γ)·Σ w²σ²/d⁴ + (z−1)²·γ/(1+s²γ)
                  − n + Σ log d² + log(1+s²γ) − Σ log σ² ]
    """
    d2 = prior_jitter(w, jitter=jitter, floor=floor).pow(2)
    var = std.pow(2)
    gamma = (w.pow(2) / d2).sum(1)
    one_plus = 1.0 + scale**2 * gamma
    trace = (var / d2).sum(1) - scale**2 / one_plus * (w.pow(2) * var / d2.pow(2)).sum(1)
    quad = (z - 1.0).pow(2) * gamma / one_plus
    logdets = torch.log(d2).sum(1) + torch.log(one_plus) - torch.log(var).sum(1)
    return 0.5 * (trace + quad - w.shape[1] + logdets).sum()


class InverseModel(nn.Module):
    """The auxiliary ``r(z_T | W)`` of one layer over its C nodes (training only).

    Parameters ``[C]``: ``c`` (projection), ``b1``, ``b2`` (eq. 11–12), offsets ``m``
    (init 1) and ``λ`` (init log σ₀); a coupling flow ``f_r`` of ``depth`` layers.
    """

    def __init__(self, dim: int, *, depth: int, hidden: int, init_std: float,
                 use_nodes: bool) -> None:
        super().__init__()
        self.use_nodes = bool(use_nodes)
        self.c = nn.Parameter(torch.randn(dim) / math.sqrt(dim))
        self.b1 = nn.Parameter(torch.zeros(dim))
        self.b2 = nn.Parameter(torch.zeros(dim))
        self.m = nn.Parameter(torch.ones(dim))
        self.log_std = nn.Parameter(torch.full((dim,), math.log(init_std)))
        self.flow = CouplingFlow(dim, depth=depth, hidden=hidden, scale=init_std)

    def log_prob(self, z: torch.Tensor, w: torch.Tensor, var: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """``log r(z | W)`` summed over nodes. ``z [C]``; ``w``/``var [C, n]`` the mean
        weights and σ² of q(W|z) (node view); ``weights [C, n]`` one sample ``W ~ q(W|z)``."""
        g = torch.tanh(self.c @ weights).mean()                   # ḡ = mean_j tanh((cᵀW)_j)
        mean = self.m + self.b1 * g
        precision = torch.exp(-2.0 * (self.log_std + self.b2 * g))
        if self.use_nodes:
            norm2 = w.pow(2).sum(1)
            alive = norm2 > torch.finfo(norm2.dtype).tiny
            safe = torch.where(alive, norm2, torch.ones_like(norm2))
            node = (weights * w).sum(1) / safe                    # a_i ~ N(z_i, v_i) given z
            v = (w.pow(2) * var).sum(1) / safe.pow(2)
            node_precision = torch.where(alive & (v > 0), 1.0 / v.clamp_min(1e-30),
                                         torch.zeros_like(v))
            total = precision + node_precision
            mean = (precision * mean + node_precision * node) / total
            precision = total
        zb, logdet = self.flow(z.unsqueeze(0))
        return log_normal(zb[0], mean, 1.0 / precision).sum() + logdet[0]
