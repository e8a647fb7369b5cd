"""The epinet on a classifier: ``f(x, z) = W φ + b + σ_L(φ̃, z) + α·σ_P(φ̃, z)``.

The wrapper keeps the classifier (a ``Linear``) as ``base_layer``; its input φ [R, ..., F]
is the network's penultimate features (timm ``forward_head(pre_logits=True)``, torchvision
``fc``'s input, Hugging Face ``classifier``'s input). ``φ̃ = LayerNorm(stop_grad(φ))``
(no affine: the same scale on every network). Both networks are MLPs
``g([φ̃, z]) ∈ R^{C×d}`` contracted with the index: ``σ(φ̃, z)_c = Σ_j g_cj z_j``
(Osband et al. 2023, eq. 8). ``σ_L`` is trained, its last layer starts at zero (the
epinet starts as ``base + α·σ_P``); ``σ_P``'s weights are buffers drawn once from
``prior_seed`` and never trained. Indices: one ``z ~ N(0, I_d)`` per row in training; at
prediction member ``m`` has the index :func:`index_vectors` gives it.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.context import SamplingContext, expand_plan_rows
from bayesify.core.layers import BayesianLayer
from bayesify.kit.knobs import knob_value
from bayesify.methods.epinet.config import EpinetConfig


def index_vectors(seed: int | None, members: int, dim: int, device: torch.device) -> torch.Tensor:
    """``z [M, d]``: member ``m``'s index from a generator seeded by ``(seed, m)`` (the same
    whatever M and the device); fresh draws when ``seed`` is None."""
    if seed is None:
        return torch.randn(members, dim, device=device)
    rows = [torch.randn(dim, generator=torch.Generator().manual_seed(seed * 1_000_003 + m))
            for m in range(members)]
    return torch.stack(rows).to(device)


def _mlp(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    for i, (w, b) in enumerate(layers):
        x = F.linear(x, w.to(x.dtype), b.to(x.dtype))
        if i < len(layers) - 1:
            x = F.relu(x)
    return x


class EpinetLayer(BayesianLayer):
    """Wraps the classifier ``Linear``; ``learner`` is σ_L (trained), ``prior_w{i}``/``prior_b{i}``
    the buffers of σ_P (never trained)."""

    runs_base_hooks = True  # calls the original layer

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: EpinetConfig) -> None:
        super().__init__(base_layer, context)
        if not isinstance(base_layer, nn.Linear):
            raise TypeError("the epinet wraps the classifier Linear")
        self.index_dim, self.num_classes = config.index_dim, base_layer.out_features
        self.prior_scale = float(config.prior_scale)
        dims = [base_layer.in_features + config.index_dim, *config.hidden,
                base_layer.out_features * config.index_dim]
        factory = {"device": base_layer.weight.device, "dtype": torch.float32}
        # the learner's init is seeded too (every rank and every call builds the same epinet)
        gen = torch.Generator().manual_seed(config.prior_seed + 1)
        self.learner = nn.ModuleList()
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            linear = nn.Linear(a, b, **factory)
            with torch.no_grad():
                last = i == len(dims) - 2
                linear.weight.copy_(torch.zeros(b, a) if last else
                                    torch.randn(b, a, generator=gen) * math.sqrt(2.0 / a))
                linear.bias.zero_()
            self.learner.append(linear)
        # σ_P: He-scaled hidden layers, last layer scaled so Σ_j g_cj z_j has std ≈ 1 per class
        gen = torch.Generator().manual_seed(config.prior_seed)
        self.prior_layers = len(dims) - 1
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            last = i == len(dims) - 2
            std = math.sqrt((1.0 if last else 2.0) / a) / (math.sqrt(config.index_dim) if last else 1.0)
            self.register_buffer(f"prior_w{i}", (torch.randn(b, a, generator=gen) * std).to(**factory))
            self.register_buffer(f"prior_b{i}", torch.zeros(b, **factory))
        #: capture mode: forward returns the base logits and keeps (φ, logits) here
        self.capture = False
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def num_nodes(self) -> int:
        return self.index_dim

    def prior_parameters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"prior_w{i}"), getattr(self, f"prior_b{i}"))
                for i in range(self.prior_layers)]

    def delta(self, phi: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``σ_L(φ̃, z) + α·σ_P(φ̃, z)``: ``phi [R, ..., F]``, ``z [R, d]`` → ``[R, ..., C]`` (z shared
        over the middle axes)."""
        h = phi.detach().float()
        h = F.layer_norm(h, h.shape[-1:])
        zb = z.float().view(z.shape[0], *([1] * (h.dim() - 2)), z.shape[1])
        zb = zb.expand(*h.shape[:-1], z.shape[1])
        inputs = torch.cat([h, zb], -1)
        learned = _mlp(inputs, [(m.weight, m.bias) for m in self.learner])
        g = learned
        if self.prior_scale != 0.0:
            with torch.no_grad():
                prior = _mlp(inputs, self.prior_parameters())
            g = g + self.prior_scale * prior
        g = g.view(*h.shape[:-1], self.num_classes, self.index_dim)
        return (g * zb.unsqueeze(-2)).sum(-1)

    def index_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        """``z [rows, d]``: per member (its fixed index) when the plan names members, else
        one fresh index per row."""
        plan = self.context.plan
        if plan.member is None:
            return self.context.draw(self.layer_id, rows, (self.index_dim,), device)
        table = index_vectors(plan.seed, plan.num_members, self.index_dim, device)
        return table.index_select(0, expand_plan_rows(plan.member, rows, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.capture:
            self.captured = (x, out)
            return out
        if self.context.deterministic:
            return out
        z = self.index_rows(x.shape[0], x.device)
        return out + (knob_value(self) * self.delta(x, z)).to(out.dtype)

    def extra_repr(self) -> str:
        return (f"index_dim={self.index_dim}, classes={self.num_classes}, "
                f"prior_scale={self.prior_scale}")
