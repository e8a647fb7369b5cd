"""The KL part of MNF's auxiliary bound for one layer: the prior, q(W | z) and r(z | W).

Notation (one wrapped Linear/Conv, C input nodes, fan-out n per node)::

    w   [C, n]   the base layer's (pretrained) weights, node view (:func:`node_view`)
    z_T [C]      a sample of the node noise from the flow posterior q(z_T)
    q(W | z_T) = Π_ij N(W_ij; z_i w_ij, σ_ij²)                    (Gaussian around z ∘ w)

The bound (Louizos & Welling 2017; ``−KL(q(W)‖p(W))`` bounded with the auxiliary
inverse model ``r``)::

    L = E_q(z_T, W)[ log p(y|x, W) − KL(q(W|z_T) ‖ p(W)) + log r(z_T|W) − log q(z_T) ]

so the layer's KL term (what the trainer adds as ``KL/N_train``) is an unbiased estimate
of ``E_q(z_T)[ KL(q(W|z_T)‖p(W)) + log q(z_T) − E_q(W|z_T) log r(z_T|W) ]``: the average
over K samples of z_T (only node-level terms depend on z, so K = 16 costs little next to
the O(C·n) terms, computed once), ``E log q(z_0)`` in closed form (the Gaussian's
negative entropy), and the expectation over W in closed form where r allows it.

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

**The inverse model.** ``inverse_model='paper'``: eq. 11–12, r sees W only through one
global projection ``tanh(cᵀW)``::

    r(z_b | W) = Π_i N(z_b,i; m_i + b1_i·ḡ, exp(λ_i + b2_i·ḡ)²),   ḡ = mean_j tanh((cᵀW)_j)

(``m``, ``λ`` per-node offsets added so that r starts equal to q(z_0)), one W sampled whole
per step. It cannot tell z_i from W, so at best r ≈ q(z_T) and ``log q(z_T) − log r``
cancels the entropy of q(z): the z part of the KL is then ``E (z−1)²/2s²`` alone and
shrinks the node noise towards 0. ``inverse_model='node'`` (default) gives r what W says
about each node — ``a_i = ⟨W_i, w_i⟩/‖w_i‖²``, under q(W|z) ``N(z_i, v_i)`` with
``v_i = Σ_j w_ij² σ_ij² / ‖w_i‖⁴`` — as the posterior of z_i given a_i under a learned
Gaussian ``N(m_i, e^{2λ_i})``::

    r(z_b,i | W) = N(z_b,i; (π_i m_i + a_i/v_i)/π̄_i, 1/π̄_i),   π_i = e^{−2λ_i},  π̄_i = π_i + 1/v_i

whose expectation over ``W ~ q(W|z)`` is closed form (a_i is the only W-dependence)::

    −E log r = Σ_i ½π̄_i (z_b,i − ā_i)² + ½/(v_i π̄_i) − ½ log π̄_i + ½ log 2π − log|det ∂f_r/∂z|
    ā_i = (π_i m_i + z_i/v_i)/π̄_i

so the z part of the KL is ≈ ``KL(q(z)‖N(1, s²))`` (iBNN's) and no W is sampled. In both
``z_b = f_r(z_T)``, the output of r's own coupling flow (depth ``inverse_flow_depth``).
Both forms are valid auxiliary bounds; only their tightness differs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bayesify.errors import BayesifyError
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


def node_prior_terms(w: torch.Tensor, std: torch.Tensor, *, scale: float, jitter: float,
                     floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The two parts of ``KL(q(W|z) ‖ p(W))`` (closed form): ``(const [], curvature [C])``
    with ``KL = const + ½ Σ_i curvature_i (z_i − 1)²``.

    ``w [C, n]`` pretrained weights, ``std [C, n]`` σ of q(W|z); the prior is
    ``N(w_i, D_i + s² w_i w_iᵀ)`` per node (module docstring). With ``γ = Σ_j w²/d²``::

        KL_i = ½[ Σ σ²/d² − s²/(1+s²γ)·Σ w²σ²/d⁴ + (z−1)²·γ/(1+s²γ)
                  − n + Σ log d² + log(1+s²γ) − Σ log σ² ]
    """
    d2 = prior_jitter(w, jitter=jitter, floor=floor).pow(2)
    var = std.pow(2)
    gamma = (w.pow(2) / d2).sum(1)
    one_plus = 1.0 + scale**2 * gamma
    trace = (var / d2).sum(1) - scale**2 / one_plus * (w.pow(2) * var / d2.pow(2)).sum(1)
    logdets = torch.log(d2).sum(1) + torch.log(one_plus) - torch.log(var).sum(1)
    return 0.5 * (trace - w.shape[1] + logdets).sum(), gamma / one_plus


def node_prior_kl(w: torch.Tensor, std: torch.Tensor, z: torch.Tensor, *, scale: float,
                  jitter: float, floor: float) -> torch.Tensor:
    """``KL(q(W|z) ‖ p(W))`` summed over the layer, for ``z [C]`` or ``[K, C]`` → ``[]`` / ``[K]``."""
    const, curvature = node_prior_terms(w, std, scale=scale, jitter=jitter, floor=floor)
    return const + 0.5 * ((z - 1.0).pow(2) * curvature).sum(-1)


def node_statistic_variance(w: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``v [C]``: the variance of ``a_i = ⟨W_i, w_i⟩/‖w_i‖²`` under q(W|z) (inf for a node
    whose weights are all zero: W says nothing about it)."""
    precision = node_statistic_precision(w, var)
    return torch.where(precision > 0, 1.0 / precision, torch.full_like(precision, math.inf))


def node_statistic_precision(w: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``1/v [C]``, exactly 0 for a node whose weights are all zero (pruned channels of a
    pretrained network, e.g. EfficientNet-Lite0's depthwise convolutions).

    The bound is written with the precision, not ``v``: with ``v = inf`` the forward was
    finite but the backward of ``1/(v·π̄)`` is ``inf/inf`` = NaN, which made the first
    optimiser step write NaN into ``inverse.log_std`` of every such layer."""
    norm2 = w.pow(2).sum(1)
    alive = norm2 > torch.finfo(norm2.dtype).tiny
    safe = torch.where(alive, norm2, torch.ones_like(norm2))  # no 0/0 in the backward
    spread = (w.pow(2) * var).sum(1)
    precision = safe.pow(2) / torch.where(alive, spread, torch.ones_like(spread))
    return torch.where(alive, precision, torch.zeros_like(precision))


class InverseModel(nn.Module):
    """The auxiliary ``r(z_T | W)`` of one layer over its C nodes (training only).

    Parameters ``[C]``: offsets ``m`` (init 1) and ``log_std`` λ (init log σ₀); with
    ``use_nodes=False`` (the paper's eq. 11–12) also ``c``, ``b1``, ``b2``; a coupling flow
    ``f_r`` of ``depth`` layers.
    """

    def __init__(self, dim: int, *, depth: int, hidden: int, init_std: float,
                 use_nodes: bool) -> None:
        super().__init__()
        self.use_nodes = bool(use_nodes)
        self.m = nn.Parameter(torch.ones(dim))
        self.log_std = nn.Parameter(torch.full((dim,), math.log(init_std)))
        if not self.use_nodes:
            self.c = nn.Parameter(torch.randn(dim) / math.sqrt(dim))
            self.b1 = nn.Parameter(torch.zeros(dim))
            self.b2 = nn.Parameter(torch.zeros(dim))
        self.flow = CouplingFlow(dim, depth=depth, hidden=hidden, scale=init_std)

    def neg_log_prob(self, z: torch.Tensor, w: torch.Tensor, var: torch.Tensor,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
        """``−E_q(W|z) log r(z | W)`` (``use_nodes``: closed form) or ``−log r(z | W)`` for the
        sample ``weights [C, n]`` (the paper's form), summed over nodes.

        ``z [K, C]`` (the paper's form: K = 1); ``w``/``var [C, n]`` the mean weights and
        σ² of q(W|z) (node view). Returns ``[K]``.
        """
        zb, logdet = self.flow(z)
        if self.use_nodes:
            inv_v = node_statistic_precision(w, var)
            prior = torch.exp(-2.0 * self.log_std)
            total = prior + inv_v
            mean = (prior * self.m + z * inv_v) / total
            terms = (0.5 * total * (zb - mean).pow(2) + 0.5 * inv_v / total
                     - 0.5 * torch.log(total) + _HALF_LOG_2PI)
            return terms.sum(-1) - logdet
        if weights is None:
            raise BayesifyError("the paper's inverse model r(z|W) needs a sample of W")
        g = torch.tanh(self.c @ weights).mean()                   # ḡ = mean_j tanh((cᵀW)_j)
        mean = self.m + self.b1 * g
        var_r = torch.exp(2.0 * (self.log_std + self.b2 * g))
        return -log_normal(zb, mean, var_r).sum(-1) - logdet
