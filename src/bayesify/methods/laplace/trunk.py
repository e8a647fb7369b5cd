"""Feature layers: a last-layer Laplace whose variance also sees earlier depths.

The model, extended: ``f(x) = W φ(x) + b + Σ_k V_k ψ̃_k(x)`` with ``V_k = 0`` — connections
of weight zero from the pooled output ``ψ_k`` of a few normalisation layers (BatchNorm,
LayerNorm, GroupNorm, InstanceNorm) to the logits, so the function (the MAP) is the
network's own. Their inputs are standardised on the training data,
``ψ̃_k = (ψ_k − μ_k) · s_k`` with ``s_k² = E‖a‖² / E‖ψ_k − μ_k‖²`` (``a``: the classifier's
input), so one prior precision τ means the same at every depth. Under the feature curvature
(a Gaussian likelihood on the logits, std σ: ``curvature='features'``) the posterior of
``V = [V_1 … V_K]`` is exactly ``I_C ⊗ (Ψ̃ᵀΨ̃/σ² + τI)⁻¹`` and, taken independent of the
classifier's (block-diagonal across layers, as KFAC is), it adds to every class's
functional variance the same term

    v(x) = ψ̃(x)ᵀ (Ψ̃ᵀΨ̃/σ² + τI)⁻¹ ψ̃(x)        (ψ̃ = [ψ̃_1 … ψ̃_K])

— a Mahalanobis distance of the input's intermediate features from the training data's.
The classifier's features alone are what the network made class-separable; what it saw
at earlier depths tells inputs unlike the training data apart where the last features do
not (measured: ``benchmarks/RESULTS.md``, "Feature layers").

Everything is summed in one pass (``Σψ``, ``Σψψᵀ``, ``Σ‖a‖²``, N): the centring and the
scales follow from the moments, and the sums reduce over DDP ranks like the curvature.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: normalisation layers ``feature_layers='auto'`` chooses among
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
#: layers ``'auto'`` takes, evenly spaced in module order (all when there are fewer)
AUTO_LAYERS = 4
#: bound on the summed width of the feature layers (the posterior is width × width)
MAX_WIDTH = 8192
#: buffers of the classifier's LaplaceLayer (float64 sums)
BUFFERS = ("trunk_sum", "trunk_outer", "trunk_head_sq", "trunk_count")


def width(module: nn.Module) -> int | None:
    """The feature count of a normalisation layer (None: not one, or no single count)."""
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return int(module.num_features)
    if isinstance(module, nn.GroupNorm):
        return int(module.num_channels)
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) >= 1:
        return int(module.normalized_shape[-1])
    return None


def auto_layers(model: nn.Module, classifier: str) -> list[str]:
    """Up to :data:`AUTO_LAYERS` normalisation layers outside the classifier, evenly spaced
    over the network's normalisation layers in module order (first and last included), their
    summed width at most :data:`MAX_WIDTH` (the widest dropped first)."""
    norms = [(n, width(m)) for n, m in model.named_modules()
             if isinstance(m, NORMS) and width(m) and n
             and not (classifier and (n == classifier or n.startswith(classifier + ".")))]
    if len(norms) > AUTO_LAYERS:
        last = len(norms) - 1
        picks = sorted({round(i * last / (AUTO_LAYERS - 1)) for i in range(AUTO_LAYERS)})
        norms = [norms[i] for i in picks]
    while norms and sum(w for _, w in norms) > MAX_WIDTH:
        norms.remove(max(norms, key=lambda item: item[1]))
    return [n for n, _ in norms]


def check_layers(model: nn.Module, names: list[str]) -> list[int]:
    """The widths of ``names``; a clear error for a name that is not a normalisation layer."""
    from bayesify.errors import BayesifyError

    modules = dict(model.named_modules())
    widths = []
    for name in names:
        module = modules.get(name)
        if module is None or width(module) is None:
            what = "no such module" if module is None else f"a {type(module).__name__}"
            raise BayesifyError(
                f"method 'laplace': feature_layers names {name!r}, {what}; name BatchNorm / "
                "LayerNorm / GroupNorm / InstanceNorm layers of the model, or pass "
                "feature_layers='auto' (or None for the classifier's features alone)")
        widths.append(width(module))
    return widths


def pooled(module: nn.Module, output: Any, rows: int) -> torch.Tensor | None:
    """``[B, d]``: a normalisation layer's output averaged over every axis but the batch and
    its features (axis 1 for BatchNorm / GroupNorm / InstanceNorm and channels-first
    LayerNorms, the last axis for LayerNorm); None when it is not ``[B, …]`` with d there."""
    out = output[0] if isinstance(output, (tuple, list)) and output else output
    d = width(module)
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[0] != rows:
        return None
    axes = (-1, 1) if isinstance(module, nn.LayerNorm) else (1, -1)
    for axis in axes:
        if out.shape[axis] == d:
            moved = out.movedim(axis, -1)
            return moved.reshape(rows, -1, d).mean(1) if moved.dim() > 2 else moved
    return None


class Taps:
    """Keeps the last output of each feature layer while installed (forward hooks)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.names = list(names)
        self.modules = [model.get_submodule(n) for n in self.names]
        self.outputs: dict[int, Any] = {}

    def features(self, rows: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, list[str]]:
        """``[B, Σ d_k]`` pooled outputs (zeros, and the name reported, where a layer gave none
        of that batch's rows)."""
        parts, missing = [], []
        for i, module in enumerate(self.modules):
            got = pooled(module, self.outputs.get(i), rows)
            if got is None:
                missing.append(self.names[i])
                got = torch.zeros(rows, width(module), device=device, dtype=dtype)
            parts.append(got.to(device, dtype))
        return torch.cat(parts, dim=1), missing

    @contextmanager
    def installed(self) -> Iterator[Taps]:
        handles = [m.register_forward_hook(
            lambda _m, _i, out, i=i: self.outputs.__setitem__(i, out.detach()
                                                              if isinstance(out, torch.Tensor)
                                                              else out))
            for i, m in enumerate(self.modules)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.outputs = {}


def register_buffers(layer: nn.Module, total_width: int) -> None:
    """The sums on the classifier's ``LaplaceLayer`` (float64; zero until fitted)."""
    device = layer.n_data.device
    f64 = {"device": device, "dtype": torch.float64}
    layer.register_buffer("trunk_sum", torch.zeros(total_width, **f64))
    layer.register_buffer("trunk_outer", torch.zeros(total_width, total_width, **f64))
    layer.register_buffer("trunk_head_sq", torch.zeros((), **f64))
    layer.register_buffer("trunk_count", torch.zeros((), **f64))


def accumulate(layer: nn.Module, psi: torch.Tensor, a: torch.Tensor) -> None:
    """Add a batch: ``ψ [B, Σd]`` (pooled outputs), ``a [B, D]`` (the classifier's input)."""
    psi = psi.double()
    layer.trunk_sum.add_(psi.sum(0))
    layer.trunk_outer.add_(psi.T @ psi)
    layer.trunk_head_sq.add_(a.double().square().sum())
    layer.trunk_count.add_(psi.shape[0])


def fitted(layer: nn.Module) -> bool:
    return hasattr(layer, "trunk_count") and float(layer.trunk_count) > 0


class TrunkPosterior:
    """``v(x) = ψ̃ᵀ (Ψ̃ᵀΨ̃/σ² + τI)⁻¹ ψ̃`` from the layer's sums (see the module docstring);
    ``widths``: the feature layers' widths, in order."""

    def __init__(self, layer: nn.Module, widths: list[int], logit_std: float) -> None:
        n = layer.trunk_count.clamp_min(1)
        self.mu = layer.trunk_sum / n
        second = layer.trunk_outer / n - torch.outer(self.mu, self.mu)  # E(ψ−μ)(ψ−μ)ᵀ
        head = layer.trunk_head_sq / n
        spread = second.diagonal()
        scales, start = [], 0
        for w in widths:
            m = spread[start:start + w].clamp_min(0).sum()
            s = torch.sqrt(head / m) if float(m) > 0 else torch.zeros_like(m)
            scales.append(s.expand(w))
            start += w
        self.scale = torch.cat(scales)
        a = n * second * torch.outer(self.scale, self.scale) / logit_std**2
        eig, self.q = torch.linalg.eigh(a)
        self.eig = eig.clamp_min(0)

    def projections(self, psi: torch.Tensor) -> torch.Tensor:
        """``[B, Σd]`` squared projections of ψ̃ on the eigenvectors (τ-free)."""
        return (((psi.to(self.mu) - self.mu) * self.scale) @ self.q).square()

    def variance(self, psi: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
        """``v [B]`` at τ."""
        return self.projections(psi) @ (1.0 / (self.eig + tau))

    def export_tensors(self, tau: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"trunk_mu": self.mu, "trunk_scale": self.scale, "trunk_q": self.q,
                "trunk_inv_eig": 1.0 / (self.eig + tau.reshape(-1)[0])}


def add_variance(fvar: tuple[torch.Tensor, ...], v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(diag, rowsum, total)`` of ``Σ_f + v·I_C``: every class gains ``v``, the row sums
    ``v``, the total ``C·v``."""
    diag, rowsum, total = fvar
    v = v.to(diag).unsqueeze(-1)
    return diag + v, rowsum + v, total + diag.shape[-1] * v.squeeze(-1)
