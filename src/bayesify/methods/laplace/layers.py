"""Laplace wrapper: a passthrough layer that stores its curvature and captures features.

Buffers (what the posterior stores, filled by ``LaplaceMethod.fit``):

* ``structure='kron'``: ``kron_input [D', D'] = Σ_n ã_n ã_nᵀ`` (ã = [a, 1] with a bias)
  and ``kron_output [C, C] = Σ_n Λ_n``, Λ_n = diag(p_n) − p_n p_nᵀ;
* ``structure='full'``: ``ggn_full [P, P]`` over θ = vec([W | b]) (row-major, P = C·D');
* ``structure='diag'``: ``ggn_diag [P]`` over the parameters in order (weight, then bias);

plus ``prior_precision`` (τ of this layer) and ``n_data`` (N). While ``capturing`` is
set, the forward keeps its input and output so the last-layer curvature and the
predictive need no second forward pass.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer
from bayesify.core.names import BASE_LAYER
from bayesify.errors import BayesifyError
from bayesify.methods.laplace.config import LaplaceConfig


class LaplaceLayer(BayesianLayer):
    """Wraps a Linear/Conv; its parameters are the MAP mean θ* of the Laplace posterior."""

    runs_base_hooks = True  # calls the original layer

    deals_rows = False  # every row of a pass computes alike

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext, config: LaplaceConfig) -> None:
        super().__init__(base_layer, context)
        self.structure = config.structure
        weight = base_layer.weight
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        factory = {"device": weight.device, "dtype": dtype}
        if config.structure in ("kron", "full") and not isinstance(base_layer, nn.Linear):
            raise BayesifyError(
                f"structure={config.structure!r} is implemented for a Linear classifier (the "
                f"last layer); got a {type(base_layer).__name__}. Use structure='diag' for "
                "convolutional / subnetwork targets"
            )
        self.has_bias = getattr(base_layer, "bias", None) is not None
        self.max_full_params = config.max_full_params
        self._allocate(base_layer.in_features if config.structure != "diag" else 0, factory)
        self.register_buffer("prior_precision", torch.tensor(float(config.prior_precision), **factory))
        self.register_buffer("n_data", torch.zeros((), **factory))
        self._capturing = False
        self._captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def _allocate(self, inputs: int, factory: dict) -> None:
        """The curvature buffers of ``structure`` for a classifier of ``inputs`` inputs (and
        the bias feature ``has_bias`` adds)."""
        classes = self.base_layer.out_features if hasattr(self.base_layer, "out_features") else 0
        if self.structure == "kron":
            d = inputs + int(self.has_bias)
            self.register_buffer("kron_input", torch.zeros(d, d, **factory))
            self.register_buffer("kron_output", torch.zeros(classes, classes, **factory))
        elif self.structure == "full":
            p = self.num_params()
            if p > self.max_full_params:
                raise BayesifyError(
                    f"method 'laplace': structure='full' on {p} parameters needs a {p}×{p} "
                    f"matrix; above max_full_params={self.max_full_params}. Use 'kron' or "
                    "'diag'"
                )
            self.register_buffer("ggn_full", torch.zeros(p, p, **factory))
        else:
            self.register_buffer("ggn_diag", torch.zeros(self.num_params(), **factory))

    # -- a distilled model's heads: one joint classifier ------------------------------------
    def join(self, partners: list[LaplaceLayer]) -> None:
        """Make this layer the joint classifier of itself and ``partners`` — a distilled
        model's K heads whose mean is the logits: ``f = [W_1 … W_K]·[a_1/K; …; a_K/K] + b̄``
        (b̄ the mean of their biases). Its curvature buffers are sized for the joint
        features; :attr:`captured` is the joint ``(a, f)``; the partners only capture."""
        object.__setattr__(self, "partners", list(partners))  # siblings, not submodules
        self.has_bias = True
        weight = self.base_layer.weight
        factory = {"device": weight.device, "dtype": self.prior_precision.dtype}
        for name in ("kron_input", "kron_output", "ggn_full", "ggn_diag"):
            if name in self._buffers:
                del self._buffers[name]
        self._allocate(sum(m.base_layer.in_features for m in self._heads()), factory)

    def _heads(self) -> list[LaplaceLayer]:
        return [self, *self.__dict__.get("partners", [])]

    @property
    def joint(self) -> bool:
        return bool(self.__dict__.get("partners"))

    @property
    def capturing(self) -> bool:
        return self._capturing

    @capturing.setter
    def capturing(self, value: bool) -> None:
        for head in self._heads():
            head._capturing = bool(value)

    @property
    def captured(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(input, output)`` of the last forward while capturing; joint: ``([a_1/K, …,
        a_K/K], mean of the heads' outputs)``."""
        if not self.joint:
            return self._captured
        got = [head._captured for head in self._heads()]
        if any(g is None for g in got):
            return None
        k = len(got)
        return (torch.cat([a / k for a, _ in got], dim=-1),
                torch.stack([out for _, out in got]).mean(0))

    @captured.setter
    def captured(self, value: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._captured = value
        if value is None:
            for head in self._heads():
                head._captured = None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = self.base_layer(x, *args, **kwargs)
        if self._capturing:
            self._captured = (x, out)
        return out

    def posterior_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of what the posterior is over, in ``ggn_diag``'s order: the base
        layer's parameters — except that a parametrized tensor (``torch.nn.utils.
        parametrize``: weight norm, spectral norm) is the value the layer computes from
        its originals, under its own name. A weight-normed classifier's [W | b] is then what
        the last-layer curvature is over; before, its ``g`` and ``v`` were counted (660
        parameters against the curvature's 650) and ``fit`` failed. (The subnetwork
        posterior refuses parametrized layers: its per-example Jacobians would be taken
        through ``functional_call``, which writes a computed weight back into the
        originals — :func:`refuse_parametrized`.)"""
        base = self.base_layer
        if not parametrize.is_parametrized(base):
            return list(base.named_parameters())
        computed = [(name, getattr(base, name)) for name in base.parametrizations]
        return computed + list(base.named_parameters(recurse=False))

    def num_params(self) -> int:
        if self.joint:
            return self.map_weights().numel()
        return sum(p.numel() for _, p in self.posterior_parameters())

    def mean_weight(self, name: str) -> torch.Tensor | None:
        """The posterior mean is the MAP: the base layer's own tensor."""
        return getattr(self.base_layer, name)

    def num_nodes(self) -> int:
        return self.num_params()

    def map_weights(self) -> torch.Tensor:
        """``[C, D']`` = [W | b] of a Linear layer (the MAP mean in matrix form); joint:
        ``[W_1 … W_K | b̄]``."""
        if self.joint:
            heads = [h.base_layer for h in self._heads()]
            biases = [h.bias if h.bias is not None else torch.zeros_like(h.weight[:, 0])
                      for h in heads]
            mean_bias = torch.stack(biases).mean(0)
            return torch.cat([*(h.weight for h in heads), mean_bias.unsqueeze(1)], dim=1)
        w = self.base_layer.weight
        if self.has_bias:
            return torch.cat([w, self.base_layer.bias.unsqueeze(1)], dim=1)
        return w

    def map_vector(self) -> torch.Tensor:
        """``[P]`` θ* in the order of ``ggn_diag`` (weight then bias, flattened)."""
        return torch.cat([p.reshape(-1) for _, p in self.posterior_parameters()])

    def reset_curvature(self) -> None:
        for name in ("kron_input", "kron_output", "ggn_full", "ggn_diag", "n_data",
                     "trunk_sum", "trunk_outer", "trunk_head_sq", "trunk_count"):
            if hasattr(self, name):
                getattr(self, name).zero_()

    def extra_repr(self) -> str:
        return f"structure={self.structure}, params={self.num_params()}"


def refuse_parametrized(layers: dict[str, nn.Module]) -> None:
    """A ``BayesifyError`` naming the parametrized layers (weight norm, spectral norm) among
    a subnetwork posterior's targets: its Jacobians need the tensors the layers use as
    ``functional_call`` inputs, and a parametrized weight is computed, not a parameter."""
    names = [n for n, m in layers.items()
             if parametrize.is_parametrized(getattr(m, BASE_LAYER, m))]
    if names:
        raise BayesifyError(
            f"method 'laplace': a subnetwork (diagonal) posterior over layers under "
            f"torch.nn.utils.parametrize (weight or spectral norm: {names[:5]}) is not "
            "supported — their weight is computed from other parameters. Use the last-layer "
            "posterior (targets='last_layer' on a model whose classifier gives the logits) "
            "or leave them out (exclude=[...])")
