"""Member-wise last-layer Laplace heads: a mixture of Laplace approximations
(Eschenhagen et al. 2021) on top of any family's members.

Every predictive member m of a family is a fixed network whose classifier is linear in
its input: ``f_m(x) = W_m φ_m(x) + b_m`` (ensemble copies, iBNN/rank-1 noise or dropout
samples all keep this form). Around each posterior component's head a last-layer Laplace,
fitted in one gradient-free pass over the training data after the family's fit
(:func:`fit_heads`). Its curvature (:data:`CURVATURE`) is by default that of a Gaussian
likelihood on the logits, ``Λ = I/σ²`` (σ = :data:`LOGIT_STD`; a Bayesian linear regression
on the member's features, SNGP's covariance), averaged over component k's S samples
(members ``k·S … k·S + S − 1``, which share its classifier weights)::

    A_k = 1/S Σ_s Σ_n ã_sn ã_snᵀ  [D', D'],  ã = [φ, 1];   Σ_k = (I ⊗ A_k / σ² + τ I)⁻¹

— a Kronecker product, exactly, whose variance ``ãᵀ (A_k/σ² + τI)⁻¹ ã`` is a Mahalanobis
distance of the features from the training features: it weighs every training example
alike, where the softmax GGN (``CURVATURE = "ggn"``: ``G_k = 1/S Σ_s Σ_n (diag p_sn − p_sn
p_snᵀ)``, ``Σ_k = (G_k ⊗ A_k / N + τ I)⁻¹``, or the exact GGN ``H_k`` for a classifier of at
most :data:`FULL_PARAMS` parameters, :func:`_full_ggn`) weighs each by ``p(1 − p)``, so
that confidently classified examples — most of a pretrained network's — hardly narrow it.
Measured on both quality protocols (3 seeds): the feature curvature gives lower NLL under
shift and higher OOD AUROC (``benchmarks/RESULTS.md``, "The feature curvature").

Σ_k gives member m of component k the GLM predictive ``f ~ N(f_m(x), Σ_f,m)`` with
``Σ_f,m = (I ⊗ ã_mᵀ) Σ_k (I ⊗ ã_m)``, whose diagonal grows off the data (features the
curvature has not seen). Each member's predictive is the probit
``softmax(f_m / sqrt(1 + π/8 · diag Σ_f,m))``; the model's predictive the mixture over
members (in probability space), with the predictive temperature on top (the caller's
``Prediction.scaled``). τ is a :class:`Knob` searched jointly with the temperature,
sharpening included (:func:`heads_knob`). Per component, not per member: an iBNN with 4
components × 5 samples keeps 4 factor pairs, not 20 (on a 2048-feature ResNet-50 head
that is 134 MB of ``A`` instead of 672 MB), and any number of samples per component can
be predicted with.

The result is a members :class:`~bayesify.core.prediction.Prediction` whose "member
logits" are the members' probit log-probabilities (the mixture is exact) and whose
``member_aleatoric`` is the expected entropy over each member's Gaussian
(:func:`~bayesify.core.prediction.gaussian_expected_entropy`): the decomposition counts
the within-member (Laplace) spread as epistemic, beside the spread between members — both
are posterior uncertainty. (Until the fifteenth stop the within-member spread counted as
aleatoric, and the MI's OOD AUROC fell when the heads became broad.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.batch import call_model
from bayesify.core.config import HEADS_BY_DEFAULT
from bayesify.core.extensions import provide
from bayesify.core.fitting import FitContext, Knob
from bayesify.core.locks import model_lock
from bayesify.core.names import BASE_LAYER, base_name
from bayesify.core.outputs import classifier_rows, logits_of
from bayesify.core.prediction import Prediction, gaussian_expected_entropy
from bayesify.core.selection import log_grid, prior_is_negligible
from bayesify.core.state import derived
from bayesify.core.walker import classifier_group, find_classifier
from bayesify.errors import BayesifyError
from bayesify.kit import feature_layers as trunk
from bayesify.kit.knobs import MemberTemperature

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)

#: state entries (added by :func:`fit_heads`; ``_H`` in place of ``_A``, ``_G`` for the full GGN)
_A, _G, _N, _TAU, _FITTED = ("heads_kron_input", "heads_kron_output", "heads_n_data",
                             "heads_prior_precision", "heads_fitted")
_H = "heads_ggn_full"
#: the feature layers' sums (:mod:`bayesify.kit.feature_layers`), with the feature curvature
TRUNK_ENTRIES = ("heads_trunk_sum", "heads_trunk_outer", "heads_trunk_head_sq",
                 "heads_trunk_count")
_TRUNK_CACHE = derived("laplace_heads_trunk")
#: the data count of the feature layers' precision (N; :class:`~bayesify.kit.feature_layers.
#: TrunkPosterior` ``data``): written by every fit since it counts each training example once;
#: a posterior saved before has none and keeps the precision it was searched with (every
#: member's rows counted)
_TRUNK_N = "heads_trunk_examples"
#: the exact GGN per component (``H_k [P, P]``, P = C·D') for a classifier of at most this
#: many parameters, KFAC above: on the laplace family the exact last-layer GGN gave lower
#: NLL under shift and higher OOD AUROC than KFAC on both quality protocols; per component a
#: P × P matrix and an eigendecomposition, and P·C projections per member and example
FULL_PARAMS = 1024
_CACHE = derived("laplace_heads_posterior")
_WARNED = "laplace_heads_trunk_warned"
#: τ grid of the search (log-spaced); large τ is the family's own predictive
TAU_GRID = (1e-4, 1e4, 17)
#: the predictor's seed the heads are fitted for
HEAD_SEED = 0
#: training examples (over the processes) the heads' curvature is estimated on: KFAC's
#: factors are averages that settle within thousands of examples, and a pass of every
#: member over an ImageNet-sized training set would cost as many epochs of inference as
#: there are members; the scale of the precision (N) is absorbed by the searched τ
HEADS_EXAMPLES = 10_000
#: the heads' curvature: ``"features"`` — a Gaussian likelihood on the logits of std
#: :data:`LOGIT_STD` (``Λ = I/σ²``: every example weighs alike, and the variance is a
#: Mahalanobis distance of the member's features from the training features; exact in
#: Kronecker form), or ``"ggn"`` — the softmax GGN (``Λ = diag p − p pᵀ``: a confidently
#: classified example adds almost nothing). See the laplace family's ``curvature``.
CURVATURE = "features"
LOGIT_STD = 10.0
NOT_EXPORTED = ("this family's export cannot carry laplace_heads; predict in-process, or "
                "export the family without laplace_heads")
#: the state entries a saved posterior with fitted heads holds (``bayesify.<name>``): KFAC
#: factors, or the full GGN
ENTRIES = (_A, _G, _N, _TAU, _FITTED)
FULL_ENTRIES = (_H, _N, _TAU, _FITTED)


def enabled(bnn: BayesianModel) -> bool:
    """Whether the posterior's config asks for Laplace heads (``laplace_heads=True``)."""
    return bool(getattr(bnn.posterior_config, "laplace_heads", False))


def fitted(bnn: BayesianModel) -> bool:
    return _FITTED in dict(bnn.state.named_buffers()) and bool(bnn.state.value(_FITTED))


def classifier_names(bnn: BayesianModel) -> list[str]:
    """The (base) names of the classifiers the heads sit on: the one :func:`find_classifier`
    names, or a distilled model's heads whose mean is the logits
    (:func:`~bayesify.core.walker.classifier_group`: timm's DeiT/LeViT distilled, Hugging
    Face's ``…WithTeacher``); empty where the model has no Linear."""
    group = [base_name(n) for n in classifier_group(bnn.model)]
    if len(group) > 1:
        return group
    name = find_classifier(bnn.model)
    return [] if name is None else [base_name(name)]


def classifier_modules(bnn: BayesianModel) -> list[nn.Module]:
    """The (wrapped) classifier modules of :func:`classifier_names`: their inputs are φ,
    their output (their mean) the logits."""
    names = classifier_names(bnn)
    if not names:
        raise BayesifyError("laplace_heads needs a Linear classifier in the model; none found")
    return [bnn.model.get_submodule(n) if n else bnn.model for n in names]


def classifier_shape(bnn: BayesianModel) -> tuple[int | None, int | None]:
    """``(D, C)`` of the heads' classifier: its inputs (a distilled model's heads: their
    sum, :func:`joint_rows`) and classes; None where a module is not a Linear."""
    linears = [getattr(m, BASE_LAYER, m) for m in classifier_modules(bnn)]
    inputs = [getattr(m, "in_features", None) for m in linears]
    classes = getattr(linears[0], "out_features", None)
    return (None if None in inputs else sum(inputs)), classes


def classifier_module(bnn: BayesianModel) -> nn.Module:
    """The first of :func:`classifier_modules` (the only one but for a distilled model)."""
    return classifier_modules(bnn)[0]


Calls = list[list[tuple[Any, Any]]]


@contextlib.contextmanager
def classifier_calls(bnn: BayesianModel) -> Iterator[Calls]:
    """While open, every call's ``(input, output)`` of each of :func:`classifier_modules`
    (one list per module, in call order): read by :func:`joint_rows` after a forward."""
    modules = classifier_modules(bnn)
    calls: Calls = [[] for _ in modules]

    def hook(seen: list[tuple[Any, Any]]) -> Any:
        def record(_module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            first = inputs[0] if inputs else None
            seen.append((first.detach() if isinstance(first, torch.Tensor) else first,
                         output.detach() if isinstance(output, torch.Tensor) else output))
        return record

    handles = [m.register_forward_hook(hook(seen)) for m, seen in zip(modules, calls, strict=True)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def joint_rows(calls: Calls, logits: torch.Tensor) -> tuple[torch.Tensor | None, Any]:
    """``(a [R, D], out [R, C])``: the classifier's input and output rows whose result is the
    model's ``logits [R, C]``, from the calls of :func:`classifier_calls` (concatenated in
    call order) — for a decoder's classifier at every token, the gathered rows
    (:func:`~bayesify.core.outputs.classifier_rows`); for K heads whose mean the model returns
    (a distilled model), the joint classifier ``f = [W_1 … W_K] [a_1/K; …; a_K/K] + b̄``:
    ``[a_1/K, …, a_K/K]`` and the mean of their outputs (its Laplace is one Kronecker pair
    over both heads' features, and its bias the mean of theirs). ``(None, got)`` where a
    classifier did not run or gave no tensor (``got``: its last output, or None)."""
    parts = []
    for seen in calls:
        last = seen[-1][1] if seen else None
        if not seen or not all(isinstance(a, torch.Tensor) and isinstance(o, torch.Tensor)
                               and o.dim() == a.dim() for a, o in seen):
            return None, last
        parts.append(classifier_rows(torch.cat([a for a, _ in seen]),
                                     torch.cat([o for _, o in seen]), logits))
    if len(parts) == 1:
        return parts[0]
    if any(p[0].dim() != 2 or p[1].shape != parts[0][1].shape for p in parts):
        return None, parts[-1][1]
    k = len(parts)
    return (torch.cat([a / k for a, _ in parts], dim=-1),
            torch.stack([o for _, o in parts]).mean(0))


@contextlib.contextmanager
def watching_classifier(bnn: BayesianModel) -> Iterator[Calls]:
    """While open, :func:`classifier_calls` of the classifier(s) the heads would sit on (no
    calls where the heads are off or the model has no Linear): read by :func:`settle` after
    a forward."""
    if not enabled(bnn) or not classifier_names(bnn):
        yield []
        return
    with classifier_calls(bnn) as calls:
        yield calls


def settle(bnn: BayesianModel, seen: Calls, logits: torch.Tensor, *,
           caller: str = "fit") -> None:
    """Before a fit's first step (``fit`` calls it on the first batch, the model's mean
    network in eval mode): the heads need the classifier :func:`find_classifier` names to
    give the model's logits (``seen``: its calls in that forward, :func:`watching_classifier`)
    — directly, at one position per example (a decoder's classifier at every token, the
    last one gathered: :func:`~bayesify.core.outputs.classifier_rows`), or as the mean of a
    distilled model's heads (:func:`joint_rows`). A model whose last Linear
    is elsewhere (a convolutional classifier after a trunk with
    Linear layers, a head followed by more computation) would fail only after the whole
    fit: heads on by the family's default are turned off here with a warning; asked for
    (``laplace_heads=True``), it is an error before anything has trained."""
    if not enabled(bnn):
        return
    names = classifier_names(bnn)
    got = joint_rows(seen, logits)[1] if seen else None
    if isinstance(got, torch.Tensor) and got.shape == logits.shape and torch.allclose(
            got.float(), logits.float(), atol=1e-4, rtol=1e-4):
        return
    if got is None:
        what = "did not run in the model's forward"
    elif not isinstance(got, torch.Tensor) or got.shape != logits.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        what = f"gives {shape}, not the model's logits {tuple(logits.shape)}"
    else:
        what = f"gives other values than the model's logits {tuple(logits.shape)}"
    layer = (f"the model's last Linear {names[0]!r}" if len(names) == 1
             else f"the mean of the model's heads {names}")
    reason = f"the layer they would sit on, {layer}, {what}"
    if bnn.runtime.get(HEADS_BY_DEFAULT):
        bnn.method.config = dataclasses.replace(bnn.method.config, laplace_heads=False)
        bnn.runtime[HEADS_BY_DEFAULT] = False
        logger.warning("%s: %r predicts without its member-wise Laplace heads "
                       "(laplace_heads=False): %s", caller, bnn.method_name, reason)
        return
    raise BayesifyError(
        f"laplace_heads=True needs a Linear classifier whose output is the model's logits; "
        f"{reason}. Use bayesify(model, {bnn.method_name!r}, laplace_heads=False)")


@torch.no_grad()
def settle_on(bnn: BayesianModel, batch: Any, *, caller: str = "tune") -> None:
    """:func:`settle` on the mean network's forward (eval mode) of a batch's first rows, for
    the callers outside ``fit`` (:func:`bayesify.tune` after a custom loop, ``BayesTrainer``)
    before anything costs: with the heads on by default and a last Linear that does not give
    the logits, ``tune`` failed after the search (and ``BayesTrainer`` after the whole
    training) when the heads read the classifier. Nothing to do where the heads are off or
    already fitted."""
    if not enabled(bnn) or fitted(bnn):
        return
    was_training = bnn.training
    bnn.eval()
    try:
        with bnn.deterministic():
            inputs = batch.rows(slice(0, 4)).model_input()
            with watching_classifier(bnn) as seen:
                logits = logits_of(call_model(bnn.model, inputs))
            settle(bnn, seen, logits, caller=caller)
    finally:
        bnn.train(was_training)


def trunk_names(bnn: BayesianModel) -> list[str]:
    """The heads' feature layers (``trunk.auto_layers`` of the wrapped model): with the
    feature curvature, up to four normalisation layers whose pooled, standardised outputs
    join every member's variance (as the laplace family's ``feature_layers='auto'``)."""
    if CURVATURE != "features":
        return []
    classifier = base_name(find_classifier(bnn.model) or "")
    return trunk.auto_layers(bnn.model, classifier)


def member_inputs(bnn: BayesianModel, x: Any, *, samples_per_component: int, max_rows: int,
                  seed: int | None, names: list[str] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`member_features` and, with feature layers ``names``, their pooled outputs of
    every member ``ψ [M, B, Σd]`` (float64; a layer the members share: the same rows)."""
    taps = trunk.Taps(bnn.model, names) if names else None
    with taps.installed() if taps else nullcontext():
        feats, logits = member_features(bnn, x, samples_per_component=samples_per_component,
                                        max_rows=max_rows, seed=seed)
        if taps is None:
            return feats, logits, None
        psi, missing = taps.members(logits.shape[0], logits.shape[1], torch.float64,
                                    logits.device)
    if missing and not bnn.runtime.get(_WARNED):
        bnn.runtime[_WARNED] = True
        logger.warning("laplace_heads: feature layers %s gave no [members × batch, features] "
                       "output in the member forward; their part of the variance is 0", missing)
    return feats, logits, psi


def member_features(bnn: BayesianModel, x: Any, *, samples_per_component: int, max_rows: int,
                    seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ã [M, B, D']`` (the classifier's input of every member, with a 1 for the bias)
    and the member logits ``f [M, B, C]`` (``method.member_logits``, one forward): read by a
    hook on the classifier, or the family's own ``heads_features`` — φ ``[B, D]`` shared by
    every member that adds a term after the classifier (the epinet: ``f_m = Wφ + b + δ_m(φ)``;
    δ_m does not depend on the head's weights, so the GLM is the same), or ``[M, B, D]`` where
    the members cannot run under the hook together (SWAG's vmapped samples); where it gives
    None, the hook."""
    own = getattr(bnn.method, "heads_features", None)
    got = own(bnn, x, samples_per_component=samples_per_component, seed=seed) if own else None
    if got is not None:
        phi, logits = got
        feats = torch.cat([phi, torch.ones_like(phi[..., :1])], dim=-1)
        if feats.dim() == 3:
            return feats, logits
        # one φ for every member: a stride-0 view (HeadsPosterior.variances projects it once)
        return feats.unsqueeze(0).expand(logits.shape[0], *feats.shape), logits
    try:
        with classifier_calls(bnn) as calls:
            logits = bnn.method.member_logits(bnn, x, samples_per_component=samples_per_component,
                                              max_rows=max_rows, seed=seed, deterministic=False)
    except RuntimeError as err:  # e.g. a member forward under torch.func (swag)
        raise BayesifyError(
            f"laplace_heads cannot read the classifier's features in the member forward of "
            f"{bnn.method_name!r} ({str(err)[:120]}); this family is not supported yet") from err
    m, b, c = logits.shape
    if not all(calls):
        raise BayesifyError(f"laplace_heads: the classifier {classifier_names(bnn)} did not run "
                            "in the family's member forward")
    # a decoder's classifier at every position: the rows the model gathers; a distilled
    # model's heads: the joint classifier on both heads' features
    feats, outs = joint_rows(calls, logits.reshape(m * b, c))
    if feats is None or feats.dim() != 2 or outs.shape != (m * b, c) or not torch.allclose(
            outs.reshape(m, b, c).float(), logits.float(), atol=1e-4, rtol=1e-4):
        raise BayesifyError(
            "laplace_heads needs the classifier (a Linear on [B, D] features) to produce the "
            f"members' logits; saw input {_shape(feats)}, output {_shape(outs)} for "
            f"member logits {tuple(logits.shape)}")
    feats = feats.reshape(m, b, -1)
    feats = torch.cat([feats, torch.ones_like(feats[..., :1])], dim=-1)
    return feats, logits


def _shape(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


@torch.no_grad()
def fit_heads(ctx: FitContext) -> dict[str, Any]:
    """One gradient-free pass over this rank's share of the first :data:`HEADS_EXAMPLES`
    training examples (whole batches, eval mode): per component the KFAC factors ``A_k``,
    ``G_k`` (averaged over its samples) and N, summed over the ranks, after the family's
    own search. τ starts at the narrow end of its grid (the heads ≈ the family's members)."""
    bnn = ctx.bnn
    started = time.perf_counter()
    was_training = bnn.training
    bnn.eval()
    samples = bnn.posterior_config.default_samples()
    sums: list[torch.Tensor] | None = None
    names = trunk_names(bnn)
    trunk_sums: list[torch.Tensor] | None = None
    n = 0
    try:
        quota = math.ceil(HEADS_EXAMPLES / max(ctx.world_size, 1))
        for batch in ctx.batches():
            if n >= quota:
                break
            inputs = batch.model_input()
            if names and trunk.masked_tokens(inputs):  # pooled tokens would count the padding
                names, trunk_sums = [], None
            feats, logits, psi = member_inputs(bnn, inputs,
                                               samples_per_component=samples, max_rows=1 << 30,
                                               seed=HEAD_SEED, names=names)
            if psi is not None:
                part = trunk.batch_sums(psi.reshape(-1, psi.shape[-1]),
                                        feats[..., :-1].reshape(-1, feats.shape[-1] - 1))
                trunk_sums = list(part) if trunk_sums is None else [
                    t + u for t, u in zip(trunk_sums, part, strict=True)]
            feats, probs = feats.double(), logits.double().softmax(-1)
            if CURVATURE == "ggn" and feats.shape[-1] * probs.shape[-1] <= FULL_PARAMS:
                parts = [_full_ggn(feats, probs, samples)]
            else:  # KFAC factors; for the feature curvature G_k = B/σ² I makes them exact
                if CURVATURE == "features":
                    eye = torch.eye(probs.shape[-1], dtype=probs.dtype, device=probs.device)
                    g = (feats.shape[1] / LOGIT_STD**2 * eye).expand(
                        feats.shape[0] // samples, -1, -1).clone()  # its own memory: summed, saved
                else:
                    g = _per_component(torch.diag_embed(probs.sum(1))
                                       - probs.transpose(1, 2) @ probs, samples)
                parts = [_per_component(feats.transpose(1, 2) @ feats, samples), g]
            sums = parts if sums is None else [t + u for t, u in zip(sums, parts)]
            n += feats.shape[1]
    finally:
        bnn.train(was_training)
    if sums is None:
        raise BayesifyError("laplace_heads: the training data gave no batch to fit the heads on")
    sums = [ctx.all_reduce_sum(t) for t in sums]
    a = sums[0]
    total = float(ctx.all_reduce_sum(torch.tensor(float(n), dtype=torch.float64, device=a.device)))
    curvature = {_H: sums[0]} if len(sums) == 1 else {_A: sums[0], _G: sums[1]}
    entries = {**curvature, _N: torch.tensor(total, dtype=torch.float64),
               _TAU: torch.tensor(TAU_GRID[1], dtype=torch.float64), _FITTED: torch.ones((), dtype=torch.long)}
    if trunk_sums is not None:
        entries.update(zip(TRUNK_ENTRIES, (ctx.all_reduce_sum(t) for t in trunk_sums),
                           strict=True))
        entries[_TRUNK_N] = torch.tensor(total, dtype=torch.float64)
    buffers = dict(bnn.state.named_buffers())
    stale = [*((_A, _G) if _H in curvature else (_H,)),  # an earlier fit's other structure
             *(() if trunk_sums is not None else (*TRUNK_ENTRIES, _TRUNK_N))]
    for name in stale:
        if name in buffers:
            delattr(bnn.state, name)
    for name, value in entries.items():
        if name in buffers and buffers[name].shape == value.shape:
            bnn.state.set(name, value)
        else:
            bnn.state.add(name, value.to(bnn.device))
    bnn.runtime.pop(_CACHE, None)
    bnn.runtime.pop(_TRUNK_CACHE, None)
    # the mean over the ranks, so every rank records the same (the history is shared)
    seconds = ctx.all_reduce_mean(torch.tensor(time.perf_counter() - started,
                                               dtype=torch.float64, device=a.device))
    return {"heads_components": int(a.shape[0]), "heads_n_data": total,
            **({"heads_feature_layers": names} if trunk_sums is not None else {}),
            "heads_structure": "full" if len(sums) == 1 else "kron",
            "heads_seconds": float(seconds)}


def _full_ggn(feats: torch.Tensor, probs: torch.Tensor, samples: int) -> torch.Tensor:
    """``H_k [K, P, P] = 1/S Σ_s Σ_n (diag p − p pᵀ) ⊗ ã ãᵀ`` over θ_k = vec([W_k | b_k])
    (row-major, P = C·D') from members' ``ã [M, B, D']`` and ``p [M, B, C]``: the block
    diagonal ``Σ p_c ã ãᵀ`` minus ``Jᵀ J`` with ``J = p ⊗ ã``."""
    k = feats.shape[0] // samples
    d, c = feats.shape[-1], probs.shape[-1]
    f = feats.reshape(k, -1, d)  # members component-major: [K, S·B, D']
    p = probs.reshape(k, -1, c)
    j = (p.unsqueeze(-1) * f.unsqueeze(-2)).reshape(k, -1, c * d)
    h = -(j.transpose(1, 2) @ j)
    blocks = torch.einsum("knc,knd,kne->kcde", p, f, f)
    classes = torch.arange(c, device=h.device)
    view = h.view(k, c, d, c, d)
    view[:, classes, :, classes, :] += blocks.transpose(0, 1)
    return h / samples


def unfit(bnn: BayesianModel) -> None:
    """Mark fitted heads as not fitted (the predictive is the family's own again) before the
    family's members change: heads fitted on other members are stale."""
    if fitted(bnn):
        bnn.state.set(_FITTED, 0)
        bnn.runtime.pop(_CACHE, None)
        bnn.runtime.pop(_TRUNK_CACHE, None)


def _per_component(per_member: torch.Tensor, samples: int) -> torch.Tensor:
    """``[M, ...]`` → ``[K, ...]``: the mean over each component's S samples (members are
    component-major, :func:`~bayesify.core.method.member_components`)."""
    return per_member.reshape(-1, samples, *per_member.shape[1:]).mean(1)


def skipped(family: str) -> dict[str, Any]:
    """A fit without validation data leaves the heads unfitted: their τ and the temperature
    that makes a broad head useful are chosen by the validation search, and without it the
    predictive is the family's own, exactly (logged, recorded)."""
    logger.info("%s: laplace_heads not fitted (no val_loader: the heads' τ and the "
                "temperature are chosen on validation data); the predictive is the family's "
                "own", family)
    return {"heads_fitted": False}


def restore(bnn: BayesianModel, tensors: dict[str, torch.Tensor], *,
            prefix: str = "bayesify.") -> None:
    """Before a strict load of a saved posterior (or checkpoint): add the heads' state
    entries that ``tensors`` holds (they are created by :func:`fit_heads`, so a freshly
    bayesified model lacks them), after checking that they are all there and fit the model:
    ``A [K, D+1, D+1]``, ``G [K, C, C]`` (or the full ``H [K, P, P]``, P = C·(D+1)) for K
    components and the classifier's D inputs and C outputs."""
    full = prefix + _H in tensors
    expected = FULL_ENTRIES if full else ENTRIES
    present = [name for name in (*ENTRIES, _H) if prefix + name in tensors]
    if not present or not enabled(bnn):
        return  # saved before the heads were fitted (or without heads): a plain load
    if sorted(present) != sorted(expected):
        raise BayesifyError(
            f"the saved laplace_heads state is incomplete: it has {present}, not "
            f"{list(expected)}")
    inputs, classes = classifier_shape(bnn)
    components = bnn.method.components
    if full:
        h = tensors[prefix + _H]
        p = None if inputs is None or classes is None else classes * (inputs + 1)
        fits = (h.dim() == 3 and h.shape[0] == components and h.shape[1] == h.shape[2]
                and (p is None or h.shape[1] == p))
        shapes = f"H {list(h.shape)}"
    else:
        a, g = tensors[prefix + _A], tensors[prefix + _G]
        fits = (a.dim() == 3 and g.dim() == 3 and a.shape[0] == g.shape[0] == components
                and a.shape[1] == a.shape[2] and g.shape[1] == g.shape[2]
                and (inputs is None or a.shape[1] == inputs + 1)
                and (classes is None or g.shape[1] == classes))
        shapes = f"A {list(a.shape)}, G {list(g.shape)}"
    if not fits or any(tensors[prefix + n].numel() != 1 for n in (_N, _TAU, _FITTED)):
        raise BayesifyError(
            f"the saved laplace_heads state does not fit this model's classifier ({inputs} "
            f"inputs, {classes} classes, {components} components): {shapes}")
    trunk_present = [name for name in TRUNK_ENTRIES if prefix + name in tensors]
    if trunk_present:
        width = sum(trunk.width(bnn.model.get_submodule(n)) for n in trunk_names(bnn))
        shapes_ok = (len(trunk_present) == len(TRUNK_ENTRIES)
                     and tensors[prefix + TRUNK_ENTRIES[0]].shape == (width,)
                     and tensors[prefix + TRUNK_ENTRIES[1]].shape == (width, width))
        if not shapes_ok:
            raise BayesifyError(
                f"the saved laplace_heads feature-layer sums {trunk_present} do not fit this "
                f"model's feature layers {trunk_names(bnn)} ({width} features)")
        expected = (*expected, *TRUNK_ENTRIES)
        if prefix + _TRUNK_N in tensors:  # saved since the precision counts N (else: rows)
            if tensors[prefix + _TRUNK_N].numel() != 1:
                raise BayesifyError(f"the saved {_TRUNK_N} is not a scalar")
            expected = (*expected, _TRUNK_N)
    buffers = dict(bnn.state.named_buffers())
    if _TRUNK_N in buffers and _TRUNK_N not in expected:
        delattr(bnn.state, _TRUNK_N)  # an earlier fit's: the loaded sums count rows
    for name in expected:
        if name not in buffers:
            bnn.state.add(name, torch.zeros_like(tensors[prefix + name], device=bnn.device))
    bnn.runtime.pop(_CACHE, None)
    bnn.runtime.pop(_TRUNK_CACHE, None)


def set_prior_precision(bnn: BayesianModel, tau: float) -> None:
    bnn.state.set(_TAU, tau)


#: the name of the heads' τ knob (records: ``heads_prior_precision``, ``…_grid``, …)
KNOB_NAME = "heads_prior_precision"


def heads_knob(bnn: BayesianModel) -> list[Knob]:
    """τ of every member's head on a log grid (smallest = broadest), once fitted; the
    search scores the whole grid from one member forward per batch (``grid_log_probs``)."""
    if not enabled(bnn) or not fitted(bnn):
        return []
    grid = tuple(log_grid(TAU_GRID))
    return [Knob(name=KNOB_NAME, grid=grid,
                 meaning="prior precision τ of the member-wise Laplace heads; smaller is broader",
                 set=lambda tau: set_prior_precision(bnn, tau), prefer="smallest", initial=None,
                 sharpens=True,
                 grid_log_probs=lambda x: grid_log_probs(bnn, x, grid),
                 broad_limit=lambda: prior_is_negligible(_posterior(bnn).eig, min(grid)),
                 widen=(f"the heads' τ grid is fixed ({TAU_GRID[0]:g} to {TAU_GRID[1]:g}): the "
                        "validation data asked for more spread off the data than the heads "
                        "give; a shift_loader showing the shift you expect decides it better "
                        "than the library's perturbations"))]


@torch.no_grad()
def grid_log_probs(bnn: BayesianModel, x: Any, taus: tuple[float, ...]) -> list[torch.Tensor]:
    """``[B, C]`` log-probabilities of the default predictive (T = 1) at every τ of ``taus``
    from one member forward: the features and logits do not depend on τ, and the variance's
    τ-free part is computed once. Equal to setting each τ and predicting."""
    samples = bnn.posterior_config.default_samples()
    view = trunk_posterior(bnn)
    with model_lock(bnn):
        feats, logits, psi = member_inputs(bnn, x, samples_per_component=samples, max_rows=4096,
                                           seed=HEAD_SEED, names=view and view.names)
    posterior = _posterior(bnn)
    mean, scale = _member_scale(bnn, logits.double())
    variances = posterior.variances(feats, taus)
    if view is not None:
        projected = view.projections(psi)
        variances = [var + (projected @ (1.0 / (view.eig + tau))).unsqueeze(-1)
                     for var, tau in zip(variances, taus, strict=True)]
    return [Prediction(_probits(mean, var * scale).float()).raw_log_probs for var in variances]


def _member_scale(bnn: BayesianModel, mean: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The family's member temperature t, where it has one: ``f/t ~ N(f*/t, Σ_f/t²)`` →
    ``(f*/t, 1/t²)``; else ``(f*, 1)``."""
    if isinstance(bnn.method, MemberTemperature):
        t = bnn.state.get_buffer(bnn.method.knob_name).to(mean)
        return mean / t, 1.0 / t.square()
    return mean, 1.0


def _probits(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``[M, B, C]`` every member's probit log-probabilities ``log softmax(f / sqrt(1 + π/8
    var))`` (the members of the mixture)."""
    return torch.log_softmax(mean / torch.sqrt(1.0 + math.pi / 8.0 * var), dim=-1)


class HeadsPosterior:
    """Every component's precision, eigendecomposed once (cached in ``bnn.runtime``).

    * KFAC: ``G_k ⊗ A_k / N + τI`` with eigenvalues ``λ_G λ_Aᵀ / N + τ`` (``eig [K, C, D']``)
      and eigenvectors ``Q_G ⊗ Q_A``: ``diag Σ_f = ((Q_Aᵀ ã)² · 1/(eig + τ)ᵀ) · (Q_G²)ᵀ``;
    * full: ``H_k + τI = Q diag(λ + τ) Qᵀ`` (``eig [K, P]``): with ``u = Qᵀ (I ⊗ ã)`` ``[P, C]``
      per member and example, ``diag Σ_f = Σ_p u_p² / (λ_p + τ)``.
    """

    #: bound on the elements of one chunk of full projections ``u² [K, rows, P, C]``
    CHUNK = 2**24

    def __init__(self, bnn: BayesianModel) -> None:
        # a model moved to half precision (bnn.to(torch.bfloat16)) carries its factors in it:
        # eigh has no half kernels, and the factors' spectrum needs the range
        buffers = {k: trunk.wide(v) for k, v in bnn.state.named_buffers()}
        self.full = _H in buffers
        if self.full:
            eig, self.q = torch.linalg.eigh(buffers[_H])
            self.eig = eig.clamp_min(0)  # H is PSD: rounding below 0 is noise
        else:
            eig_a, self.q_a = torch.linalg.eigh(buffers[_A])
            eig_g, self.q_g = torch.linalg.eigh(buffers[_G])
            n = buffers[_N].clamp_min(1)
            self.eig = eig_g.clamp_min(0).unsqueeze(2) * eig_a.clamp_min(0).unsqueeze(1) / n

    @property
    def components(self) -> int:
        return self.eig.shape[0]

    def _full_q(self, d: int) -> torch.Tensor:
        k, p = self.eig.shape
        return self.q.view(k, p // d, d, p)  # [K, C, D', P]

    def variances(self, feats: torch.Tensor, taus: Any) -> list[torch.Tensor]:
        """``diag Σ_f [M, B, C]`` of members ``ã [M, B, D']`` (component-major, M = K·S) at
        every τ of ``taus``, the τ-free projection computed once (in row chunks), in the
        posterior's precision. Members that read one ``ã`` (a stride-0 view over M: the
        epinet's) are projected once."""
        m, b, d = feats.shape
        k = self.components
        if m > 1 and k == 1 and feats.stride(0) == 0:
            return [v.expand(m, b, -1) for v in self.variances(feats[:1], taus)]
        f = feats.to(self.eig.dtype).reshape(k, -1, d)  # [K, S·B, D']
        if not self.full:
            projected = (f @ self.q_a).square()
            q_g_sq = self.q_g.square().transpose(1, 2)
            return [((projected @ (1.0 / (self.eig + tau)).transpose(1, 2)) @ q_g_sq)
                    .reshape(m, b, -1) for tau in taus]
        q = self._full_q(d)
        c, p = q.shape[1], q.shape[3]
        q = q.permute(0, 2, 1, 3).reshape(k, d, c * p)  # [K, D', C·P]
        weights = torch.stack([1.0 / (self.eig + tau) for tau in taus], -1)  # [K, P, T]
        rows = max(1, self.CHUNK // max(k * c * p, 1))
        parts = []
        for chunk in f.split(rows, dim=1):  # every τ in one matmul over P
            u_sq = (chunk @ q).square().reshape(k, -1, p)  # [K, n·C, P]
            parts.append((u_sq @ weights).reshape(k, chunk.shape[1], c, -1))
        var = torch.cat(parts, 1)  # [K, S·B, C, T]
        return [var[..., t].reshape(m, b, -1) for t in range(var.shape[-1])]

    def export_tensors(self, tau: torch.Tensor, d: int) -> dict[str, torch.Tensor]:
        """What the exported heads need at ``τ`` (no eigendecomposition in the graph)."""
        if self.full:
            return {"q_full": self._full_q(d), "inv_eig": 1.0 / (self.eig + tau)}
        return {"q_a": self.q_a, "inv_eig": 1.0 / (self.eig + tau), "q_g_sq": self.q_g.square()}


def _posterior(bnn: BayesianModel) -> HeadsPosterior:
    cached = bnn.runtime.get(_CACHE)
    if cached is None:
        cached = bnn.runtime[_CACHE] = HeadsPosterior(bnn)
    return cached


def trunk_posterior(bnn: BayesianModel) -> trunk.TrunkPosterior | None:
    """The heads' feature-layer posterior (one for every member, from the sums over all
    members), with ``.names``; None where the heads were fitted without one."""
    if _TRUNK_CACHE in bnn.runtime:
        return bnn.runtime[_TRUNK_CACHE]
    buffers = dict(bnn.state.named_buffers())
    view = None
    if all(name in buffers for name in TRUNK_ENTRIES) and float(buffers[TRUNK_ENTRIES[3]]) > 0:
        names = trunk_names(bnn)
        widths = [trunk.width(bnn.model.get_submodule(n)) for n in names]
        if sum(widths) != buffers[TRUNK_ENTRIES[0]].shape[0]:
            raise BayesifyError(
                f"laplace_heads: the saved feature-layer sums have width "
                f"{buffers[TRUNK_ENTRIES[0]].shape[0]}, this model's feature layers {names} "
                f"{sum(widths)}")
        view = trunk.TrunkPosterior(tuple(trunk.wide(buffers[n]) for n in TRUNK_ENTRIES), widths,
                                    LOGIT_STD,
                                    examples=float(buffers[_N]),
                                    data=float(buffers[_TRUNK_N]) if _TRUNK_N in buffers
                                    else None)
        view.names = names
    bnn.runtime[_TRUNK_CACHE] = view
    return view


def functional_variance(posterior: HeadsPosterior, feats: torch.Tensor,
                        tau: torch.Tensor | float) -> torch.Tensor:
    """``diag Σ_f [M, B, C]`` of members ``ã [M, B, D']`` (component-major, M = K·S), each in
    its component's posterior (:class:`HeadsPosterior`)."""
    return posterior.variances(feats, [tau])[0]


def heads_predictive(bnn: BayesianModel, x: Any, *, samples_per_component: int, max_rows: int,
                     seed: int | None = None, deterministic: bool = False) -> Prediction:
    """The mixture over members of each member's probit GLM predictive (see module doc)."""
    view = trunk_posterior(bnn)
    feats, logits, psi = member_inputs(bnn, x, samples_per_component=samples_per_component,
                                       max_rows=max_rows, seed=seed, names=view and view.names)
    posterior = _posterior(bnn)
    if feats.shape[0] % posterior.components:
        raise BayesifyError(
            f"laplace_heads were fitted for {posterior.components} posterior components; this "
            f"prediction has {feats.shape[0]} members, not a whole number per component")
    tau = bnn.state.get_buffer(_TAU)
    var = functional_variance(posterior, feats, tau)
    if view is not None:  # the feature layers' v(x), the same for every class
        var = var + view.variance(psi, tau).unsqueeze(-1)
    mean, scale = _member_scale(bnn, logits.double())
    var = var * scale
    return Prediction(_probits(mean, var).float(),
                      member_aleatoric=gaussian_expected_entropy(mean, var))


def predictive_if_fitted(bnn: BayesianModel, x: Any, **kwargs: Any) -> Prediction | None:
    """The heads' predictive when the config asks for them and they are fitted, else None."""
    if kwargs.get("deterministic") or not enabled(bnn) or not fitted(bnn):
        return None
    return heads_predictive(bnn, x, **kwargs)


provide("laplace_heads", predictive_if_fitted)
