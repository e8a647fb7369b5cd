"""Masked affine coupling flows over the node noise ``z`` of one layer (RealNVP).

MNF (Louizos & Welling 2017) makes ``q(z)`` expressive by pushing a diagonal Gaussian
sample through a normalizing flow::

    z_0 ~ N(μ_z, diag σ_z²),   z_T = f_T ∘ … ∘ f_1(z_0),
    log q(z_T) = log q(z_0) − Σ_t log |det ∂f_t / ∂z_{t−1}|

with the paper's masked RealNVP couplings (Dinh et al. 2017)::

    m = mask of f_t,   h = tanh(A (m ⊙ u) + a)
    u' = m ⊙ u + (1 − m) ⊙ (u ⊙ γ(h) + τ(h)),   log |det| = Σ (1 − m) ⊙ log γ(h)

Design notes (what differs from the paper's code, and why):

* **standardised coordinates** — the flow acts on ``u = (z − 1) / σ₀`` (σ₀ the initial
  std of q(z_0)) and maps back with ``z = 1 + σ₀·u``; the affine change of variables
  cancels in the log-determinant. Around a pretrained network z ≈ 1 ± 0.05, so without
  it the coupling networks would see inputs of size 0.05 and a unit step of a gate would
  move z by 100 per cent;
* **exact identity at init** — the paper's gate ``z σ(k) + (1 − σ(k)) μ`` is the identity
  only as σ(k) → 1. Here the gate is ``γ = 2·sigmoid(k(h))`` (bounded in (0, 2) like the
  paper's, so a step cannot blow z up) and the shift ``τ(h)`` is a free head; both heads
  start at zero, so a fresh flow is exactly the identity and the wrapped network is
  exactly the pretrained one;
* **fixed alternating masks** — the authors redraw a Bernoulli(½) mask at every call
  (and use ½ at test time); a fixed mask (even channels, then odd) keeps every member a
  fixed function, which prediction, export and save/load need.
"""

from __future__ import annotations

import torch
from torch import nn


class Coupling(nn.Module):
    """One masked affine coupling ``u [R, C] → (u' [R, C], log|det| [R])``.

    ``parity``: the channels ``c`` with ``c % 2 == parity`` condition (are kept), the
    others are transformed. With C = 1 and parity 1 the single channel is transformed by
    an affine map whose coefficients are learned constants.
    """

    def __init__(self, dim: int, hidden: int, parity: int) -> None:
        super().__init__()
        self.parity = int(parity)
        self.hidden = nn.Linear(dim, hidden)
        self.heads = nn.Linear(hidden, 2 * dim)  # [gate logit k, shift τ]
        nn.init.zeros_(self.heads.weight)
        nn.init.zeros_(self.heads.bias)

    def mask(self, u: torch.Tensor) -> torch.Tensor:
        """``m [C]``: 1 on the conditioning channels."""
        channels = torch.arange(u.shape[-1], device=u.device)
        return (channels % 2 == self.parity).to(u.dtype)

    def forward(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mask(u)
        h = torch.tanh(self.hidden(m * u))
        gate_logit, shift = self.heads(h).chunk(2, dim=-1)
        gate = 2.0 * torch.sigmoid(gate_logit)
        out = m * u + (1.0 - m) * (u * gate + shift)
        logdet = ((1.0 - m) * torch.log(gate)).sum(-1)
        return out, logdet


class CouplingFlow(nn.Module):
    """``z_T = f_T ∘ … ∘ f_1(z_0)`` on ``[R, C]`` with the summed log-determinant ``[R]``.

    ``depth`` 0 is the identity (``z`` returned as it is, log|det| = 0), so a depth-0 MNF
    layer computes exactly what iBNN's does.
    """

    def __init__(self, dim: int, *, depth: int, hidden: int, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)
        self.layers = nn.ModuleList(Coupling(dim, hidden, parity=t % 2) for t in range(depth))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = torch.zeros(z.shape[:-1], device=z.device, dtype=z.dtype)
        if not self.layers:
            return z, logdet
        u = (z - 1.0) / self.scale
        for layer in self.layers:
            u, step = layer(u)
            logdet = logdet + step
        return 1.0 + self.scale * u, logdet
