"""``bnn.summary()``: what was injected where, and how big the posterior is.

One row per wrapped layer: its type, its random variables per member and the
posterior values it stores. The random variables are what the family samples —
input nodes (ibnn, dropout), rank-1 factor entries (rank1, batchensemble) or the
layer's weights (swag, laplace, meanfield, hypernet) — and the header says which.
Posterior values count trainable parameters *and* posterior state (buffers:
Laplace's curvature, SWAG's moments and deviations, per-member BatchNorm
statistics), so a post-hoc family does not show an empty posterior.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from bayesify.core.names import in_base_layer

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def _posterior_sizes(layer: nn.Module) -> tuple[int, int]:
    """``(trainable values, state values)`` of a wrapper, its base layer excluded."""
    trainable = sum(p.numel() for n, p in layer.named_parameters()
                    if not in_base_layer(n) and p.requires_grad)
    frozen = sum(p.numel() for n, p in layer.named_parameters()
                 if not in_base_layer(n) and not p.requires_grad)
    state = sum(b.numel() for n, b in layer.named_buffers() if not in_base_layer(n))
    return trainable, frozen + state


def _unit(layers: dict[str, nn.Module]) -> str:
    """"weights" when every layer's random variables are (at least) its base weights, else
    "nodes"; extra modules without random variables (e.g. BatchNorm statistics) aside."""
    def weight_count(layer: nn.Module) -> int:
        weight = getattr(layer.base_layer, "weight", None)
        return weight.numel() if isinstance(weight, nn.Parameter) else 0

    counted = [layer for layer in layers.values() if layer.num_nodes() > 0]
    if counted and all(layer.num_nodes() >= weight_count(layer) > 0 for layer in counted):
        return "weights"
    return "nodes"


def summarize(bnn: BayesianModel) -> str:
    """The table of :meth:`BayesianModel.summary`."""
    layers = bnn.bayesian_layers()
    unit = _unit(layers) if layers else "nodes"
    rows = [("layer", "type", f"random {unit}", "posterior values")]
    total_trainable = total_state = 0
    for name, layer in layers.items():
        trainable, state = _posterior_sizes(layer)
        total_trainable, total_state = total_trainable + trainable, total_state + state
        count = layer.num_nodes()
        rows.append((name, type(layer.base_layer).__name__, str(count) if count else "-",
                     f"{trainable + state}" + (f" ({state} state)" if state else "")))
    family_state = sum(b.numel() for b in bnn.state.buffers())
    base = sum(p.numel() for p in bnn.base_parameters())
    frozen = not any(p.requires_grad for p in bnn.base_parameters())
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    title = (f"bayesify[{bnn.method_name}] {type(bnn.model).__name__}: {len(rows) - 1} "
             f"layer(s) wrapped, components={bnn.method.components}")
    lines = [title]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(
        f"random {unit} per member: {bnn.num_nodes()}; posterior values: "
        f"{total_trainable} trainable + {total_state + family_state} state; base "
        f"parameters: {base} ({'frozen' if frozen else 'trainable'})")
    if bnn.skipped:
        lines.append(f"skipped: {bnn.skipped}")
    return "\n".join(lines)
