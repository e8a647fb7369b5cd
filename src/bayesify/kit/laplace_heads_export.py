"""Export of member-wise Laplace heads (:mod:`bayesify.kit.laplace_heads`).

The family's own export module ``E: x → [M, B, C]`` (frozen noise tables, stacked member
networks, …) is reused with every copy of the classifier replaced by
:class:`LogitsAndFeatures`, which returns ``[f, ã]`` — its logits and its input — side by
side on the last axis. Whatever ``E`` does to route rows to members (tiling, stacking,
``index_select`` of components) it does to both, so its output ``[M, B, C + D]`` splits into
the members' logits and the features the in-process heads read with a forward hook on the
same module. :class:`HeadsMembers` then computes, with the posterior precomputed at the
chosen τ into buffers (no eigendecomposition in the graph)::

    ã = [φ, 1],  s = (Q_Aᵀ ã)² · 1/(λ_G λ_Aᵀ/N + τ),  diag Σ_f = s · (Q_G²)ᵀ   (KFAC)
    u = Qᵀ (I ⊗ ã),  diag Σ_f = Σ_p u_p² / (λ_p + τ)                           (full GGN)
    (per member, in its component's posterior)
    member m: N(f_m/t, diag Σ_f / t²)

(``t``: the family's member temperature, 1 where it has none) — the members' Gaussians,
whose probits the exported predictor mixes and tempers exactly as in process, with the
aleatoric part over the same fixed draws
(:func:`~bayesify.core.prediction.gaussian_expected_entropy`).
The export pipeline's own check compares the file with the in-process predictive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.batch import example_batch
from bayesify.core.names import BASE_LAYER, base_name
from bayesify.core.outputs import logits_of
from bayesify.errors import BayesifyError
from bayesify.kit import laplace_heads as heads
from bayesify.kit.knobs import MemberTemperature

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


class LogitsAndFeatures(nn.Module):
    """Stands in for a copy of the classifier: ``a [R, D] → [R, C + D]`` = ``[f(a), a]`` (at
    every position, ``[R, L, C + D]``, for a decoder's classifier). One of a distilled
    model's K heads: ``[f_k(a_k), 0, a_k, 0]``, zeros of the other heads' widths
    (``before``, ``after``) around its input, so the model's mean of its heads is
    ``[logits, a_1/K, …, a_K/K]`` — the joint classifier's features
    (:func:`~bayesify.kit.laplace_heads.joint_rows`)."""

    def __init__(self, classifier: nn.Module, before: int = 0, after: int = 0) -> None:
        super().__init__()
        self.classifier = classifier
        self.before, self.after = int(before), int(after)

    def forward(self, a: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.classifier(a, *args, **kwargs)
        # a decoder's classifier at every position ([R, L, C]): the model's own gather of the
        # last token picks the features of the same row
        logits = out if isinstance(out, torch.Tensor) and out.dim() == a.dim() == 3 else logits_of(out)
        parts = [logits, a.to(logits.dtype)]
        if self.before or self.after:
            pad = a.new_zeros(*a.shape[:-1], 1).to(logits.dtype)
            parts = [logits, pad.expand(*a.shape[:-1], self.before), parts[1],
                     pad.expand(*a.shape[:-1], self.after)]
        return torch.cat(parts, dim=-1)


class RecordingTap(nn.Module):
    """Stands in for a copy of a feature layer: its output, every call kept for
    :class:`HeadsMembers` to pool (read back after the forward, as the classifier's
    features are)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[Any] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        self.calls.append(out)
        return out


class HeadsMembers(nn.Module):
    """``x → [2, M, B, C]``: every member's Gaussian over the logits, ``(f_m/t, diag Σ_f,m/t²)``
    (see the module docstring); :attr:`gaussian_members` names their link."""

    #: the output is a mixture of Gaussians over the logits with this link (the exported
    #: predictor mixes their probits and takes the aleatoric part over their draws)
    gaussian_members = "probit"

    def __init__(self, members: nn.Module, *, num_classes: int, tensors: dict[str, torch.Tensor],
                 member_temperature: float, taps: list[list[RecordingTap]] | None = None,
                 names: list[str] | None = None) -> None:
        super().__init__()
        self.members = members
        self.num_classes = int(num_classes)
        self.member_temperature = float(member_temperature)
        object.__setattr__(self, "taps", taps or [])  # submodules of members already
        self.names = list(names or [])
        self.modes: list[str] | None = None  # set by _fix_modes before tracing
        for key, value in tensors.items():
            self.register_buffer(key, value.detach().clone())

    def _calls(self) -> list[list[torch.Tensor | None]]:
        """Every feature layer's pooled calls of the last forward (then forgotten)."""
        calls = [[heads.trunk.pooled(tap.inner, out, heads.trunk._rows(out))
                  for tap in copies for out in tap.calls] for copies in self.taps]
        for copies in self.taps:
            for tap in copies:
                tap.calls = []
        return calls

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.members(*args, **kwargs)  # [M, B, C + D]
        logits, feats = out[..., :self.num_classes], out[..., self.num_classes:]
        feats = torch.cat([feats, torch.ones_like(feats[..., :1])], dim=-1).to(self.inv_eig.dtype)
        k, d = self.inv_eig.shape[0], feats.shape[-1]  # members component-major: [K, S·B, D']
        if hasattr(self, "q_full"):  # the exact GGN: Σ_p (Qᵀ (I ⊗ ã))_pc² / (λ_p + τ)
            u = torch.einsum("knd,kcdp->knpc", feats.reshape(k, -1, d), self.q_full)
            var = torch.einsum("knpc,kp->knc", u.square(), self.inv_eig).reshape(logits.shape)
        else:
            s = (feats.reshape(k, -1, d) @ self.q_a).square() @ self.inv_eig.transpose(1, 2)
            var = (s @ self.q_g_sq.transpose(1, 2)).reshape(logits.shape)  # [M, B, C]
        if self.taps:  # the feature layers' v(x) of every member, the same for every class
            psi, _ = heads.trunk.member_rows(
                self._calls(), self.names, [heads.trunk.width(c[0].inner) for c in self.taps],
                logits.shape[0], logits.shape[1], self.trunk_mu.dtype, logits.device,
                modes=self.modes)
            var = var + heads.trunk.distance(psi, self).unsqueeze(-1).to(var)
        t = self.member_temperature
        return torch.stack([logits.to(var.dtype) / t, var / (t * t)]).float()


def _fix_modes(module: HeadsMembers, example_input: Any) -> None:
    """One eager forward of the example: how each feature layer's calls map to the members
    (:func:`~bayesify.kit.feature_layers.row_modes`), fixed before the graph is traced."""
    with torch.no_grad():
        out = example_batch(example_input).call(module.members)
    module.modes = heads.trunk.row_modes(module._calls(), out.shape[0], out.shape[1])


def export_heads(bnn: BayesianModel, *, samples_per_component: int, seed: int,
                 example_input: Any) -> nn.Module:
    """The plain ``x → [M, B, C]`` module of the heads' predictive (see module docstring)."""
    method = bnn.method
    temperature = 1.0
    if isinstance(method, MemberTemperature):  # the family's export must give raw logits
        temperature = bnn.state.value(method.knob_name)
        bnn.state.set(method.knob_name, 1.0)
    try:
        family = method.export_module(bnn, samples_per_component=samples_per_component,
                                      seed=seed, example_input=example_input)
    finally:
        if isinstance(method, MemberTemperature):
            bnn.state.set(method.knob_name, temperature)
    with_features = getattr(family, "with_features", None)
    if callable(with_features):  # the family's module hands [f_m, φ] out itself (epinet)
        family = with_features()
    else:
        _read_features(bnn, family)
    posterior = heads._posterior(bnn)
    tau = bnn.state.get_buffer(heads._TAU).to(posterior.eig)
    inputs, classes = heads.classifier_shape(bnn)
    if inputs is None or classes is None:
        raise BayesifyError(f"laplace_heads: the classifier {heads.classifier_names(bnn)} is not "
                            f"a Linear; {heads.NOT_EXPORTED}")
    tensors = posterior.export_tensors(tau, inputs + 1)
    view = heads.trunk_posterior(bnn)
    taps = None
    if view is not None:
        tensors.update(view.export_tensors(tau))
        taps = [_tap_copies(bnn, family, name) for name in view.names]
    module = HeadsMembers(family, num_classes=classes, tensors=tensors,
                          member_temperature=temperature, taps=taps,
                          names=view.names if view is not None else None).eval()
    if taps:
        _fix_modes(module, example_input)
    return module


def _tap_copies(bnn: BayesianModel, family: nn.Module, name: str) -> list[RecordingTap]:
    """Every copy of the feature layer ``name`` in the family's export module (the deepest
    normalisation layers named like it, in member order), replaced by a
    :class:`RecordingTap`."""
    matches = [n for n, m in family.named_modules()
               if (n == name or n.endswith("." + name)) and heads.trunk.width(m)
               and base_name(n) == n]
    copies = [n for n in matches if not any(o.startswith(n + ".") for o in matches)]
    if not copies:
        raise BayesifyError(
            f"laplace_heads: the export module of {bnn.method.name!r} holds no copy of the "
            f"feature layer {name!r}; {heads.NOT_EXPORTED}")
    taps = []
    for qualified in copies:
        parent_name, _, attr = qualified.rpartition(".")
        parent = family.get_submodule(parent_name) if parent_name else family
        taps.append(RecordingTap(getattr(parent, attr)))
        setattr(parent, attr, taps[-1])
    return taps


def _read_features(bnn: BayesianModel, family: nn.Module) -> None:
    """Replace every copy of the classifier (of each of a distilled model's heads) in the
    family's export module by :class:`LogitsAndFeatures`, so the module's output is
    ``[M, B, C + D]``."""
    method = bnn.method
    names = heads.classifier_names(bnn)
    widths = [getattr(getattr(m, BASE_LAYER, m), "in_features", 0)
              for m in heads.classifier_modules(bnn)]
    for k, name in enumerate(names):
        matches = [n for n, _ in family.named_modules()
                   if name and (n == name or n.endswith("." + name))]
        # the deepest matches: with a classifier named "2" in a Sequential, the stacked
        # members' container "models.2" matches too, and holds the real copy "models.2.2"
        copies = [n for n in matches if not any(o.startswith(n + ".") for o in matches)]
        if not copies:
            raise BayesifyError(
                f"laplace_heads: the export module of {method.name!r} holds no copy of the "
                f"classifier {name!r}, so the heads' features cannot be read; "
                f"{heads.NOT_EXPORTED}")
        for qualified in copies:
            parent_name, _, attr = qualified.rpartition(".")
            parent = family.get_submodule(parent_name) if parent_name else family
            setattr(parent, attr, LogitsAndFeatures(
                getattr(parent, attr), before=sum(widths[:k]), after=sum(widths[k + 1:])))
