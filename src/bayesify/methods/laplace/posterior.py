"""What the Laplace posterior stores and computes: precision ``H + τI``, log-determinants,
functional (GLM) variances, samples and the Laplace marginal likelihood.

All classes are thin views over the curvature buffers of the wrapped layers; τ is
passed explicitly (a tensor, differentiable for marginal-likelihood tuning).
Functional variance of the linearised model ``f ~ N(f*, J Σ Jᵀ)`` is returned as
three ``[B, C]``/``[B]`` pieces — ``diag Σ_f``, ``Σ_f 1`` and ``1ᵀ Σ_f 1`` — which is
all that the probit and bridge links need, so no ``[B, C, C]`` is ever built.
"""

from __future__ import annotations

import torch

from bayesify.core.gaussian import bridge_log_probs, probit_log_probs  # noqa: F401
from bayesify.methods.laplace.layers import LaplaceLayer

FunctionalVariance = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class LastLayerKron:
    """Precision ``G ⊗ A / N + τI`` over θ = vec([W | b]) (KFAC: E[Λ⊗ããᵀ] ≈ E[Λ]⊗E[ããᵀ]).

    With ``A = Q_A diag(λ_A) Q_Aᵀ`` and ``G = Q_G diag(λ_G) Q_Gᵀ`` the precision has
    eigenvectors ``Q_G ⊗ Q_A`` and eigenvalues ``λ_G λ_Aᵀ / N + τ``.
    """

    def __init__(self, layer: LaplaceLayer) -> None:
        self.layer = layer
        n = layer.n_data.clamp_min(1)
        eig_a, self.q_a = torch.linalg.eigh(layer.kron_input)
        eig_g, self.q_g = torch.linalg.eigh(layer.kron_output)
        self.eig = torch.outer(eig_g.clamp_min(0), eig_a.clamp_min(0)) / n  # [C, D']
        self.mean = layer.map_weights().detach()  # [C, D']

    @property
    def num_params(self) -> int:
        return self.eig.numel()

    def log_det(self, tau: torch.Tensor) -> torch.Tensor:
        return torch.log(self.eig + tau).sum()

    def precision(self, tau: torch.Tensor) -> torch.Tensor:
        """Dense ``[P, P]`` precision (tests / small layers only)."""
        n = self.layer.n_data.clamp_min(1)
        h = torch.kron(self.layer.kron_output, self.layer.kron_input) / n
        return h + tau * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)

    def functional_variance(self, feats: torch.Tensor, tau: torch.Tensor) -> FunctionalVariance:
        """``Σ_f = Q_G diag(s) Q_Gᵀ`` per example with ``s_g = Σ_a (Q_Aᵀã)_a² / (λ_g λ_a/N + τ)``."""
        s = (feats @ self.q_a).square() @ (1.0 / (self.eig + tau)).T  # [B, C]
        q1 = self.q_g.sum(0)  # Q_Gᵀ 1
        diag = s @ self.q_g.square().T
        rowsum = (s * q1) @ self.q_g.T
        return diag, rowsum, (s * q1.square()).sum(-1)

    def sample_weights(self, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """``[S, C, D']`` samples from standard normal ``z [S, C, D']``: W* + Q_G (z/√(λ+τ)) Q_Aᵀ."""
        return self.mean + self.q_g @ (z / torch.sqrt(self.eig + tau)) @ self.q_a.T


class LastLayerDiag:
    """Precision ``diag(h) + τI``; ``h [C, D']`` in matrix form of [W | b]."""

    def __init__(self, layer: LaplaceLayer) -> None:
        self.layer = layer
        c = layer.base_layer.out_features
        flat = layer.ggn_diag
        d = layer.base_layer.in_features
        weight = flat[: c * d].view(c, d)
        self.h = torch.cat([weight, flat[c * d:].view(c, 1)], 1) if layer.has_bias else weight
        self.mean = layer.map_weights().detach()

    @property
    def num_params(self) -> int:
        return self.h.numel()

    def log_det(self, tau: torch.Tensor) -> torch.Tensor:
        return torch.log(self.h + tau).sum()

    def precision(self, tau: torch.Tensor) -> torch.Tensor:
        """Dense ``[P, P]`` precision over vec([W | b]) (tests)."""
        return torch.diag(self.h.reshape(-1) + tau)

    def functional_variance(self, feats: torch.Tensor, tau: torch.Tensor) -> FunctionalVariance:
        """Σ_f is diagonal: ``Σ_f[c, c] = Σ_d ã_d² / (h_cd + τ)``."""
        diag = feats.square() @ (1.0 / (self.h + tau)).T
        return diag, diag, diag.sum(-1)

    def sample_weights(self, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return self.mean + z / torch.sqrt(self.h + tau)


def full_blocks(cov: torch.Tensor, c: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ [P, P]`` over vec([W | b]) (P = C·D') → ``(Σ_cc [C, D', D'], Σ_c· 1 [C, D', D'])``:
    the diagonal class blocks and the blocks summed over the second class."""
    cov = cov.view(c, d, c, d)
    return cov.diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous(), cov.sum(2).contiguous()


def full_blocks_variance(feats: torch.Tensor, blocks: torch.Tensor,
                         rows: torch.Tensor) -> FunctionalVariance:
    """``Σ_de ã_d M[c, d, e] ã_e`` for both :func:`full_blocks` as two matmuls (an einsum
    over three operands makes torch.export specialise the batch size); in process and in
    the exported module alike."""
    c, d = blocks.shape[0], blocks.shape[1]
    diag = ((feats @ blocks.permute(1, 0, 2).reshape(d, c * d)).view(-1, c, d)
            * feats.unsqueeze(1)).sum(-1)
    rowsum = ((feats @ rows.permute(1, 0, 2).reshape(d, c * d)).view(-1, c, d)
              * feats.unsqueeze(1)).sum(-1)
    return diag, rowsum, rowsum.sum(-1)


class LastLayerFull:
    """Precision ``H + τI`` with the full ``[P, P]`` GGN over θ = vec([W | b]).

    ``H = Q diag(λ) Qᵀ`` is decomposed once per fit; every τ then costs no factorisation:
    ``log|H + τI| = Σ log(λ + τ)`` and, with ``u = Qᵀ (I ⊗ ã)`` ``[P, C]`` per example,
    ``Σ_f = uᵀ diag(1/(λ + τ)) u`` — so the search scores its whole τ grid from one
    projection of the features (:meth:`functional_variances`), and the evidence's Adam steps
    on log τ cost no Cholesky each.
    """

    #: bound on B·P·C elements of one chunk of projected features ``u``
    CHUNK = 2**24

    def __init__(self, layer: LaplaceLayer) -> None:
        self.layer = layer
        self.h = layer.ggn_full
        self.mean = layer.map_weights().detach()
        # float64 where it is cheap (the small eigenvalues set the broadest τ's variance)
        exact = self.h.double() if self.h.shape[0] <= 2048 else self.h
        eig, q = torch.linalg.eigh(exact)
        self.eig = eig.clamp_min(0).to(self.h.dtype)  # H is PSD: rounding below 0 is noise
        self.q = q.to(self.h.dtype)
        self._cache: tuple[float, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_params(self) -> int:
        return self.h.shape[0]

    def precision(self, tau: torch.Tensor) -> torch.Tensor:
        """Dense ``[P, P]`` precision (tests)."""
        return self.h + tau * torch.eye(self.h.shape[0], dtype=self.h.dtype, device=self.h.device)

    def log_det(self, tau: torch.Tensor) -> torch.Tensor:
        return torch.log(self.eig + tau).sum()

    def root(self, tau: torch.Tensor) -> torch.Tensor:
        """``R = Q diag(1/√(λ + τ))`` ``[P, P]``: ``R Rᵀ = Σ``."""
        return self.q * torch.rsqrt(self.eig + tau.reshape(-1)[0])

    def blocks(self, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`full_blocks` of ``Σ`` at ``τ`` (cached for the last τ)."""
        key = float(tau.reshape(-1)[0])
        if self._cache is None or self._cache[0] != key:
            c, d = self.mean.shape
            root = self.root(tau)
            self._cache = (key, *full_blocks(root @ root.T, c, d))
        return self._cache[1], self._cache[2]

    def functional_variance(self, feats: torch.Tensor, tau: torch.Tensor) -> FunctionalVariance:
        """At one τ (the predictor's): from ``Σ``'s blocks, the exported module's arithmetic."""
        return full_blocks_variance(feats, *self.blocks(tau))

    def functional_variances(self, feats: torch.Tensor,
                             taus: list[torch.Tensor]) -> list[FunctionalVariance]:
        """:meth:`functional_variance` at every τ of ``taus`` from one projection."""
        c, d = self.mean.shape
        p = self.eig.shape[0]
        q = self.q.view(c, d, p).permute(1, 0, 2).reshape(d, c * p)  # [D', C·P]
        weights = torch.stack([1.0 / (self.eig + tau.reshape(-1)[0]) for tau in taus], -1)
        rows = max(1, self.CHUNK // max(p * c, 1))
        diag, rowsum, total = [], [], []
        for chunk in feats.split(rows):  # every τ in one matmul over P
            u = (chunk @ q).view(-1, c, p)  # [b, C, P]
            u1 = u.sum(1)  # [b, P]: Qᵀ (1 ⊗ ã)
            diag.append((u.square().reshape(-1, p) @ weights).view(-1, c, len(taus)))
            rowsum.append(((u * u1.unsqueeze(1)).reshape(-1, p) @ weights).view(-1, c, len(taus)))
            total.append(u1.square() @ weights)
        diag_t, rowsum_t, total_t = torch.cat(diag), torch.cat(rowsum), torch.cat(total)
        return [(diag_t[..., t], rowsum_t[..., t], total_t[:, t]) for t in range(len(taus))]

    def sample_weights(self, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        root = self.root(tau)  # a sample needs no P × P covariance
        s = z.shape[0]
        return self.mean + (z.reshape(s, -1) @ root.T).view_as(z)


class SubnetworkDiag:
    """Diagonal Laplace over any set of layers: precision ``diag(h) + τ_l`` per layer l."""

    def __init__(self, layers: list[LaplaceLayer]) -> None:
        self.layers = layers
        self.h = torch.cat([layer.ggn_diag for layer in layers])
        self.sizes = [layer.num_params() for layer in layers]

    @property
    def num_params(self) -> int:
        return self.h.numel()

    def expand(self, tau: torch.Tensor) -> torch.Tensor:
        """τ (scalar or ``[L]``) → ``[P]``."""
        if tau.numel() == 1:
            return tau.reshape(()).expand(self.h.shape)
        sizes = torch.tensor(self.sizes, device=tau.device)
        return tau.repeat_interleave(sizes)

    def log_det(self, tau: torch.Tensor) -> torch.Tensor:
        return torch.log(self.h + self.expand(tau)).sum()

    def precision(self, tau: torch.Tensor) -> torch.Tensor:
        return torch.diag(self.h + self.expand(tau))

    def variance(self, tau: torch.Tensor) -> torch.Tensor:
        return 1.0 / (self.h + self.expand(tau))

    def functional_variance_from_jacobians(self, jac: torch.Tensor, tau: torch.Tensor) -> FunctionalVariance:
        """From ``J [B, C, P]``: diag = Σ_p J_cp² σ_p², rowsum = Σ_p J_cp σ_p² Σ_k J_kp."""
        var = self.variance(tau).to(jac.dtype)
        col = jac.sum(1)  # [B, P]
        diag = jac.square() @ var
        rowsum = (jac * var) @ col.unsqueeze(2)
        return diag, rowsum.squeeze(2), (col.square() * var).sum(-1)


def curvature_eigenvalues(posterior: object) -> torch.Tensor:
    """The eigenvalues of a posterior's curvature (precision − τI): ``eig`` of the KFAC and
    full views, the diagonal ``h`` of the diagonal ones."""
    eig = getattr(posterior, "eig", None)
    return eig if eig is not None else posterior.h  # type: ignore[attr-defined]


def log_marginal_likelihood(
    log_det_posterior: torch.Tensor,
    tau: torch.Tensor,
    *,
    loss: torch.Tensor,
    map_sq_norms: torch.Tensor,
    sizes: list[int],
) -> torch.Tensor:
    """Laplace evidence ``log p(D) ≈ −ℓ(θ*) − ½(log|H+τ| − Σ_l P_l log τ_l) − ½ Σ_l τ_l ‖θ*_l‖²``.

    ``loss`` = summed training cross-entropy at θ*, ``map_sq_norms [L]`` and ``sizes``
    per layer; ``tau`` scalar or ``[L]`` (prior mean 0, as in laplace-torch).
    """
    tau_l = tau.reshape(-1).expand(len(sizes)) if tau.numel() == 1 else tau
    sizes_t = torch.tensor(sizes, dtype=tau.dtype, device=tau.device)
    log_det_prior = (sizes_t * torch.log(tau_l)).sum()
    scatter = (tau_l * map_sq_norms).sum()
    return -loss - 0.5 * (log_det_posterior - log_det_prior) - 0.5 * scatter


