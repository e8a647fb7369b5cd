"""The per-layer generator MLP of Bayes by Hypernet and its noise source.

``G: z [k, d] → [k, out]`` (or ``[k, C, out]`` for per-output-channel slices,
where the channel one-hot enters the first layer as an embedding, as in the
paper's ``G([z, c])``). Initialisation, chosen so fine-tuning starts at the
pretrained network *and* the posterior has spread from the first step:

* every bias is zero and the slice embedding is zero, so every hidden
  activation at ``z = 0`` is 0 (LeakyReLU(0) = 0) and ``G(0) = 0``: the z = 0
  network is exactly the pretrained one, whatever the hidden weights;
* the head is *not* zero-initialised: with ``G ≡ 0`` every sample would be
  identical, the nearest-neighbour KL (log of the distance between posterior
  samples) would be infinite and the generator would get no spread to learn
  from. Its weights are drawn so that ``std(G(z)) ≈ init_scale`` over
  ``z ~ N(0, noise_scale²)``, i.e. a posterior of relative width ``init_scale``
  around the pretrained weights (meanfield's δ), and every layer gets gradient.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.kit.weightspace import member_normal

#: stream id of the one noise draw that every layer reads when noise is shared
SHARED_STREAM = -1


class WeightGenerator(nn.Module):
    """LeakyReLU MLP ``z → G(z)``; optional per-slice conditioning embedding."""

    def __init__(
        self,
        noise_dim: int,
        hidden: tuple[int, ...],
        out_features: int,
        *,
        negative_slope: float,
        init_scale: float,
        noise_scale: float,
        num_slices: int = 0,
    ) -> None:
        super().__init__()
        self.negative_slope = negative_slope
        widths = (noise_dim, *hidden)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.slice_embedding = nn.Embedding(num_slices, hidden[0]) if num_slices else None
        self.head = nn.Linear(hidden[-1], out_features)
        with torch.no_grad():
            for layer in (*self.layers, self.head):
                layer.bias.zero_()
            if self.slice_embedding is not None:
                self.slice_embedding.weight.zero_()
            self._calibrate_head(noise_dim, init_scale, noise_scale or 1.0)

    @torch.no_grad()
    def _calibrate_head(self, noise_dim: int, init_scale: float, noise_scale: float) -> None:
        """Head weights ~ N(0, c²) with ``c`` so that the output std is ``init_scale``.

        ``Var[h·w] = E|h|²·c²`` for ``w ~ N(0, c²)`` independent of h.
        """
        device = self.head.weight.device
        z = noise_scale * torch.randn(512, noise_dim, device=device)
        h = self.trunk(z)
        power = h.pow(2).sum(-1).mean().clamp_min(1e-12)
        self.head.weight.normal_(0.0, 1.0).mul_(init_scale / power.sqrt())

    def trunk(self, z: torch.Tensor) -> torch.Tensor:
        """Hidden features ``[k, H]`` (or ``[k, C, H]`` with slices)."""
        h = self.layers[0](z)
        if self.slice_embedding is not None:
            h = h.unsqueeze(1) + self.slice_embedding.weight.unsqueeze(0)
        h = F.leaky_relu(h, self.negative_slope)
        for layer in self.layers[1:]:
            h = F.leaky_relu(layer(h), self.negative_slope)
        return h

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``z [k, d]`` → ``[k, out]`` (``[k, C, out]`` with slices)."""
        return self.head(self.trunk(z))


class NoiseSource:
    """Draws the generator noise ``z [k, d]`` of the members in a batch.

    ``shared=False``: every layer draws its own z (stream = layer id).
    ``shared=True``: one z per member feeds every layer; it is cached for the
    current top-level forward pass (``SamplingContext.pass_id``, advanced by the
    BayesianModel, so no hook is ever registered on the user's modules), and
    seeded prediction reads the same stream in every layer.
    """

    def __init__(self, dim: int, *, shared: bool) -> None:
        self.dim = dim
        self.shared = shared
        self._cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def sample(
        self, context: SamplingContext, stream: int, ids: torch.Tensor, num_members: int, device: torch.device
    ) -> torch.Tensor:
        if not self.shared:
            return member_normal(context, stream, ids, num_members, self.dim, device)
        if self._cache is not None:
            pass_id, cached_ids, z = self._cache
            if (pass_id == context.pass_id and cached_ids.shape == ids.shape
                    and cached_ids.device == ids.device and torch.equal(cached_ids, ids)):
                return z
        z = member_normal(context, SHARED_STREAM, ids, num_members, self.dim, device)
        self._cache = (context.pass_id, ids, z)
        return z

    def reset(self) -> None:
        self._cache = None
