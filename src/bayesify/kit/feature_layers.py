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
scales follow from the moments, and the sums reduce over DDP ranks like the curvature. The
posterior keeps its top ``RANK_FRACTION · N`` principal directions (:func:`rank_kept`).
Inputs that carry a mask (padded token sequences, :func:`masked_tokens`) leave the feature
layers off: pooling their tokens would count the padding.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from bayesify.core.names import BASE_LAYER, base_name
from bayesify.errors import BayesifyError

#: normalisation layers ``feature_layers='auto'`` chooses among
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
#: layers ``'auto'`` takes, evenly spaced in module order (all when there are fewer)
AUTO_LAYERS = 4
#: bound on the summed width of the feature layers (the posterior is width × width)
MAX_WIDTH = 8192
#: buffers of the classifier's LaplaceLayer (float64 sums)
BUFFERS = ("trunk_sum", "trunk_outer", "trunk_head_sq", "trunk_count")


def norm_of(module: nn.Module) -> nn.Module | None:
    """The normalisation layer ``module`` is, or wraps (a family's wrapper around one)."""
    if isinstance(module, NORMS):
        return module
    inner = getattr(module, BASE_LAYER, None)
    return inner if isinstance(inner, NORMS) else None


def width(module: nn.Module) -> int | None:
    """The feature count of a normalisation layer (or a wrapper of one); None: not one, or
    no single count."""
    module = norm_of(module)
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return int(module.num_features)
    if isinstance(module, nn.GroupNorm):
        return int(module.num_channels)
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) >= 1:
        return int(module.normalized_shape[-1])
    return None


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 where it is in half precision (a posterior moved with
    ``bnn.to(torch.bfloat16)``): the curvature's eigendecomposition has no half kernels."""
    return t.double() if t.dtype in (torch.float16, torch.bfloat16) else t


def auto_layers(model: nn.Module, classifier: str) -> list[str]:
    """Up to :data:`AUTO_LAYERS` normalisation layers outside the classifier, evenly spaced
    over the network's normalisation layers in module order (first and last included), their
    summed width at most :data:`MAX_WIDTH` (the widest dropped first)."""
    norms = [(n, width(m)) for n, m in model.named_modules()
             if width(m) and n and base_name(n) == n  # not inside a wrapper
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
    LayerNorms, the last axis for LayerNorm); None when it is not ``[B, …]`` with d there.

    ``[k·B, …]`` rows are read batch-major, ``[B, k, …]`` (thirty-seventh stop): LeViT's
    BatchNorm1d on flattened tokens ``[B·N, C]``, MobileViT's unfolded patches
    ``[B·P, N, C]``; their part of the variance was 0 (the layer "gave none of the rows").
    A three-dimensional ``[L, B, C]`` (sequence first) is not."""
    out = output[0] if isinstance(output, (tuple, list)) and output else output
    d = width(module)
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or rows < 1:
        return None
    n = out.shape[0]
    if n != rows and (n % rows or (out.dim() == 3 and out.shape[1] == rows)):
        return None
    axes = (-1, 1) if isinstance(norm_of(module), nn.LayerNorm) else (1, -1)
    for axis in axes:
        if out.shape[axis] == d:
            moved = out.movedim(axis, -1)  # dimension 0 stays first: rows stay batch-major
            return moved.reshape(rows, -1, d).mean(1) if moved.dim() > 2 or n != rows else moved
    return None


_PAUSE = threading.local()


@contextmanager
def paused() -> Iterator[None]:
    """Installed :class:`Taps` keep nothing inside: forward passes a family runs for its own
    bookkeeping in the middle of a member forward are not the rows being predicted (SWAG
    recomputes a sampled network's BatchNorm statistics over training batches the first time
    the network is asked for; kept, those calls broke the rows' mapping and the feature
    layers' variance fell to 0 on that batch — a sharpened predictive then lost 0.34 nats of
    clean NLL on the CNN protocol's test split)."""
    _PAUSE.depth = getattr(_PAUSE, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSE.depth -= 1


class Taps:
    """Keeps the outputs of each feature layer while installed (forward hooks; every call
    outside :func:`paused`)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.names = list(names)
        self.modules = [model.get_submodule(n) for n in self.names]
        self.outputs: dict[int, list[Any]] = {}

    def _keep(self, i: int, out: Any) -> None:
        if getattr(_PAUSE, "depth", 0):
            return
        self.outputs.setdefault(i, []).append(out.detach() if isinstance(out, torch.Tensor)
                                              else out)

    def features(self, rows: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, list[str]]:
        """``[B, Σ d_k]`` pooled outputs of one forward of B rows (zeros, and the name
        reported, where a layer gave none of that batch's rows)."""
        parts, missing = [], []
        for i, module in enumerate(self.modules):
            calls = self.outputs.get(i) or [None]
            got = pooled(module, calls[-1], rows)
            if got is None:
                missing.append(self.names[i])
                got = torch.zeros(rows, width(module), device=device, dtype=dtype)
            parts.append(got.to(device, dtype))
        return torch.cat(parts, dim=1), missing

    def members(self, members: int, rows: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, list[str]]:
        """``[M, B, Σ d_k]`` of a member forward: per layer, every call's pooled rows in order,
        ``M·B`` of them (members tiled or stacked) or ``B`` (a trunk the members share);
        zeros, and the name reported, otherwise."""
        return member_rows([[pooled(module, out, _rows(out)) for out in self.outputs.get(i, [])]
                            for i, module in enumerate(self.modules)],
                           self.names, [width(m) for m in self.modules], members, rows,
                           dtype, device)

    @contextmanager
    def installed(self) -> Iterator[Taps]:
        handles = [m.register_forward_hook(lambda _m, _i, out, i=i: self._keep(i, out))
                   for i, m in enumerate(self.modules)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.outputs = {}


def _rows(out: Any) -> int:
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else -1


def row_modes(calls: list[list[torch.Tensor | None]], members: int, rows: int) -> list[str]:
    """Per layer, how its pooled calls map to members: ``"members"`` (``M·B`` rows, member
    after member), ``"shared"`` (``B`` rows every member reads) or ``"none"``."""
    modes = []
    for got in calls:
        count = sum(g.shape[0] for g in got) if got and all(g is not None for g in got) else -1
        modes.append("members" if count == members * rows else
                     "shared" if count == rows else "none")
    return modes


def member_rows(calls: list[list[torch.Tensor | None]], names: list[str], widths: list[int],
                members: int, rows: int, dtype: torch.dtype, device: torch.device,
                modes: list[str] | None = None) -> tuple[torch.Tensor, list[str]]:
    """``[M, B, Σ d_k]`` from every layer's pooled calls (see :meth:`Taps.members`), mapped
    by ``modes`` (:func:`row_modes`; fixed ahead for a traced graph, which cannot compare
    its symbolic batch sizes)."""
    modes = row_modes(calls, members, rows) if modes is None else modes
    parts, missing = [], []
    for name, d, got, mode in zip(names, widths, calls, modes, strict=True):
        if mode == "members":
            parts.append(torch.cat(got).reshape(members, -1, d).to(device, dtype))
        elif mode == "shared":
            parts.append(torch.cat(got).to(device, dtype).unsqueeze(0).expand(members, -1, d))
        else:
            missing.append(name)
            parts.append(torch.zeros(members, rows, d, device=device, dtype=dtype))
    return torch.cat(parts, dim=-1), missing


def masked_tokens(inputs: Any) -> bool:
    """Whether the model's inputs carry a mask (an ``attention_mask`` of padded token
    sequences): pooling a layer's tokens would then count the padding, so the feature
    layers stay off and the classifier's features alone decide the variance."""
    kwargs = getattr(inputs, "kwargs", inputs if isinstance(inputs, dict) else {})
    return any("mask" in str(k) for k in kwargs)


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
    for total, part in zip(sums_of(layer), batch_sums(psi, a), strict=True):
        total.add_(part.to(total.device))


def fitted(layer: nn.Module) -> bool:
    return hasattr(layer, "trunk_count") and float(layer.trunk_count) > 0


def sums_of(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    """``(Σψ, Σψψᵀ, Σ‖a‖², N)`` of the classifier's LaplaceLayer."""
    return tuple(getattr(layer, name) for name in BUFFERS)


def batch_sums(psi: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(Σψ, Σψψᵀ, Σ‖a‖², N)`` of one batch (``ψ [R, Σd]``, ``a [R, D]``, float64)."""
    psi = psi.double()
    return (psi.sum(0), psi.T @ psi, a.double().square().sum(),
            torch.tensor(float(psi.shape[0]), dtype=torch.float64, device=psi.device))


#: the feature layers' posterior keeps its top ``RANK_FRACTION × N`` principal directions
#: (N training examples): where the pooled features are wider than the examples span, a new
#: example from the training distribution has components along directions the N examples
#: never varied in (their sample variance ~0, their posterior variance 1/τ), which would count
#: as distance for every input, not only for inputs unlike the training data
RANK_FRACTION = 0.5


def rank_kept(width: int, examples: float) -> int:
    """Principal directions kept of a ``width``-wide feature posterior fitted on ``examples``."""
    if RANK_FRACTION is None:
        return width
    return max(1, min(width, int(RANK_FRACTION * examples)))


class TrunkPosterior:
    """``v(x) = ψ̃ᵀ (Ψ̃ᵀΨ̃/σ² + τI)⁻¹ ψ̃`` from the layer's sums (see the module docstring);
    ``widths``: the feature layers' widths, in order; ``examples``: the training examples N
    the kept rank follows (:func:`rank_kept`; None: the rows summed); ``data``: the data
    count of the precision where the sums hold more rows than examples (every member's:
    ``Ψ̃ᵀΨ̃`` is then N times the rows' second moment, each example counted once, as the
    classifier's curvature counts it; None: the rows summed)."""

    def __init__(self, sums: tuple[torch.Tensor, ...], widths: list[int],
                 logit_std: float, examples: float | None = None,
                 data: float | None = None) -> None:
        total, outer, head_sq, count = sums
        n = count.clamp_min(1)
        self.mu = total / n
        second = outer / n - torch.outer(self.mu, self.mu)  # E(ψ−μ)(ψ−μ)ᵀ
        head = head_sq / n
        spread = second.diagonal()
        scales, start = [], 0
        for w in widths:
            m = spread[start:start + w].clamp_min(0).sum()
            s = torch.sqrt(head / m) if float(m) > 0 else torch.zeros_like(m)
            scales.append(s.expand(w))
            start += w
        self.scale = torch.cat(scales)
        # the data count is the training examples' (N), not the rows summed: the member-wise
        # heads sum every member's rows (K·S per example), and counting them scaled the
        # precision by K·S — K·S times less variance off the data than the same network's
        # Laplace at the same τ (dropout's 8 samples on the CNN protocol: the trunk's
        # eigenvalues exactly 8 × Laplace's), where the classifier's part counts N
        examples_n = n if data is None else torch.as_tensor(data, dtype=n.dtype, device=n.device)
        a = examples_n * second * torch.outer(self.scale, self.scale) / logit_std**2
        eig, q = torch.linalg.eigh(a)  # ascending
        keep = rank_kept(a.shape[0], float(n) if examples is None else examples)
        self.eig, self.q = eig[-keep:].clamp_min(0), q[:, -keep:]

    def projections(self, psi: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` squared projections of ψ̃ on the kept eigenvectors (τ-free)."""
        return projections(psi.to(self.mu), self.mu, self.scale, self.q)

    def variance(self, psi: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
        """``v [B]`` at τ."""
        return self.projections(psi) @ (1.0 / (self.eig + tau))

    def export_tensors(self, tau: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"trunk_mu": self.mu, "trunk_scale": self.scale, "trunk_q": self.q,
                "trunk_inv_eig": 1.0 / (self.eig + tau.reshape(-1)[0])}


def projections(psi: torch.Tensor, mu: torch.Tensor, scale: torch.Tensor,
                q: torch.Tensor) -> torch.Tensor:
    """``[…, R]`` squared projections of the standardised ``ψ̃ = (ψ − μ)·s`` on the kept
    eigenvectors ``q`` (the graph form too: :func:`distance`)."""
    return (((psi - mu) * scale) @ q).square()


def distance(psi: torch.Tensor, tensors: Any) -> torch.Tensor:
    """``v [...]`` of pooled outputs ``ψ [..., Σd]`` from an exported module's buffers
    (:meth:`TrunkPosterior.export_tensors`: ``trunk_mu``, ``trunk_scale``, ``trunk_q``,
    ``trunk_inv_eig`` at the chosen τ) — the arithmetic of :meth:`TrunkPosterior.variance`."""
    return projections(psi, tensors.trunk_mu, tensors.trunk_scale, tensors.trunk_q) \
        @ tensors.trunk_inv_eig


def add_variance(fvar: tuple[torch.Tensor, ...], v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(diag, rowsum, total)`` of ``Σ_f + v·I_C``: every class gains ``v``, the row sums
    ``v``, the total ``C·v``."""
    diag, rowsum, total = fvar
    v = v.to(diag).unsqueeze(-1)
    return diag + v, rowsum + v, total + diag.shape[-1] * v.squeeze(-1)
