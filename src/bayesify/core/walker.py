"""Plan → validate → replace: choose the layers that receive a posterior.

Targets are chosen by an explicit type table of the method (isinstance) plus
presets and include/exclude patterns on qualified module names, like PEFT's
``target_modules``. Nothing is modified until the whole plan is valid.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from bayesify.core.layers import BayesianLayer
from bayesify.core.method import Method, wrapper_for
from bayesify.core.names import BASE_LAYER, posterior_name
from bayesify.core.weight_reads import source_weight_readers
from bayesify.errors import BayesifyError

logger = logging.getLogger(__name__)

#: parents that read a child's weights directly instead of calling it: a wrapper
#: around such a child would be bypassed silently, so these children are skipped.
WEIGHT_READING_PARENTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


#: pre-hooks that recompute ``weight`` before a forward (old-style weight / spectral norm,
#: pruning): a wrapper computes with the weight they left, as the layer does (frozen base)
_RECOMPUTE_WEIGHT = (WeightNorm, SpectralNorm, prune.BasePruningMethod)


def fused_qat(module: nn.Module) -> str:
    """Why a fused quantisation-aware-training module (``torch.ao.nn.intrinsic.qat``:
    ``ConvBnReLU2d``, ``ConvReLU2d``, ``LinearReLU`` …, what ``prepare_qat`` makes of fused
    conv-BN-ReLU) gets no posterior; "" for any other module. Its output is not its weight's
    operation plus a bias — the ReLU, the folded BatchNorm come after — so the families that
    add a bias or scale the output after the weight's operation (rank1, batchensemble,
    ensemble, dropout with ``train_weights``) computed another network (max |Δ logit| 0.10
    on a small fused CNN). Wrappers that call the layer (``runs_base_hooks``) keep it."""
    if type(module).__module__.startswith("torch.ao.nn.intrinsic.qat"):
        return (f"a fused quantisation-aware {type(module).__name__}: its forward applies "
                "more than the weight and a bias (BatchNorm folding, an activation)")
    return ""


def hooked(module: nn.Module) -> str:
    """Why a layer with forward hooks of its own gets no posterior; "" without any. A
    wrapper computes the layer itself: a hook on the original layer would never run (a
    plain layer), or run on the output before the bias is added (a layer with its own
    forward) — quantisation-aware training's activation fake-quantisation is such a hook
    (max |Δ logit| 0.09 on one Linear)."""
    hooks = [*module._forward_hooks.values(),
             *(h for h in module._forward_pre_hooks.values()
               if not isinstance(h, _RECOMPUTE_WEIGHT))]
    if not hooks:
        return ""
    names = sorted({getattr(h, "__name__", type(h).__name__) for h in hooks})
    return (f"forward hooks of its own ({', '.join(names)}): a wrapper would skip them or "
            "apply them before the bias")


@dataclass
class TargetPlan:
    """Result of planning: the names to wrap, and what was seen and skipped why."""

    targets: list[str]
    skipped: dict[str, str] = field(default_factory=dict)
    seen_types: Counter = field(default_factory=Counter)
    #: target name → the other names the same module object is registered under
    aliases: dict[str, list[str]] = field(default_factory=dict)


def module_aliases(model: nn.Module) -> dict[str, list[str]]:
    """First qualified name → every other name of the same module object.

    ``named_modules()`` yields a shared module once; a wrapper installed under the
    first name only would be bypassed through the others.
    """
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            names.setdefault(id(module), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


def _check_model_type(model: nn.Module) -> None:
    scripted = [n or "<model>" for n, m in model.named_modules()
                if isinstance(m, (torch.jit.ScriptModule, torch.jit.RecursiveScriptModule))]
    if scripted:
        raise TypeError(
            f"bayesify needs the eager PyTorch module, but {scripted[:3]} is a TorchScript "
            "module (torch.jit.script / torch.jit.trace output), whose layers cannot be "
            "wrapped; pass the nn.Module you scripted (before torch.jit.script) instead"
        )


def _check_pattern_types(name: str, value: object) -> None:
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        return
    raise TypeError(
        f"{name} must be a list of module names / regex patterns (str), e.g. "
        f"{name}=['fc', 'layer4.*']; got {value!r} ({type(value).__name__})"
    )


def name_matches(name: str, pattern: str) -> bool:
    """Exact name, ``.suffix`` match, or regex full match."""
    if name == pattern or name.endswith("." + pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def _matches_any(name: str, patterns: Iterable[str]) -> bool:
    return any(name_matches(name, p) for p in patterns)


def _timm_classifier(model: nn.Module) -> Any:
    """What timm's ``get_classifier()`` returns (a module, or a tuple of a distilled model's
    heads), or None (no such method; a headless model that raises)."""
    get_classifier = getattr(model, "get_classifier", None)
    if not callable(get_classifier):
        return None
    try:
        return get_classifier()
    except Exception:  # noqa: BLE001 - some models raise when headless
        return None


def find_classifier(model: nn.Module) -> str | None:
    """Qualified name of the classifier: timm ``get_classifier()`` or the last Linear. In a
    wrapped model, the classifier the user's network has: a wrapper's ``base_layer``, never a
    module the wrapper adds (a hypernet's weight generator, MNF's auxiliary flow: their
    Linears come after the base layer in module order)."""
    head = _timm_classifier(model)
    if isinstance(head, nn.Module):
        for name, module in model.named_modules():
            if module is head:
                if isinstance(head, (nn.Linear, nn.modules.conv._ConvNd)):
                    return name
                last = [n for n, m in _user_modules(head) if isinstance(m, nn.Linear)]
                if last:
                    return f"{name}.{last[-1]}" if name else last[-1]
    linears = [n for n, m in _user_modules(model) if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def classifier_group(model: nn.Module) -> list[str]:
    """Every classifier whose outputs the model combines into its logits: a distilled
    model's two heads (timm's DeiT/LeViT/EfficientFormer ``get_classifier()`` returns
    ``(head, head_dist)``; Hugging Face's ``…WithTeacher`` classes name the second one
    ``distillation_classifier`` or ``classifier_distill``), whose mean the model returns in
    eval mode. Otherwise the one :func:`find_classifier` finds (or none)."""
    heads = _timm_classifier(model)
    if isinstance(heads, (tuple, list)) and len(heads) > 1:
        names = {id(m): n for n, m in _user_modules(model)}
        found = []
        for head in heads:
            if isinstance(head, nn.Linear) and id(head) in names:
                found.append(names[id(head)])
            elif isinstance(head, nn.Module) and id(head) in names:
                inner = [n for n, m in _user_modules(head) if isinstance(m, nn.Linear)]
                if inner:
                    found.append(f"{names[id(head)]}.{inner[-1]}")
        if len(found) == len(heads):
            return found
    last = find_classifier(model)
    if last is None:
        return []
    if any(re.fullmatch(r"(.*_)?(head_?dist|dist(illation)?_(head|classifier)|"
                        r"classifier_dist(ill)?)", part) for part in last.split(".")):
        linears = [(n, m) for n, m in _user_modules(model) if isinstance(m, nn.Linear)]
        modules = dict(linears)
        shape = (modules[last].in_features, modules[last].out_features)
        before = [n for n, m in linears[:-1] if n != last
                  and (m.in_features, m.out_features) == shape]
        if before and linears[-1][0] == last:
            return [before[-1], last]
    return [last]


def _user_modules(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``named_modules`` as the user's network has them: of a wrapper (:class:`BayesianLayer`)
    only its ``base_layer`` (named ``<wrapper>.base_layer``), not the modules it adds."""
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if isinstance(module, BayesianLayer):
            inside.append(f"{name}." if name else "")
            base = getattr(module, BASE_LAYER, None)
            if isinstance(base, nn.Module):
                yield posterior_name(name, BASE_LAYER), base
            continue
        yield name, module


def plan_targets(model: nn.Module, method: Method) -> TargetPlan:
    """Compute (without modifying anything) the qualified names to wrap."""
    config = method.config
    _check_model_type(model)
    for option in ("include", "exclude"):
        _check_pattern_types(option, getattr(config, option))
    plan = TargetPlan(targets=[])
    skip_children: dict[str, str] = {}
    candidates: list[str] = []
    for name, module in model.named_modules():
        plan.seen_types[type(module).__name__] += 1
        if isinstance(module, BayesianLayer):
            raise BayesifyError(
                f"the model is already bayesified (module {name!r} is a "
                f"{type(module).__name__}); call .unwrap() first or wrap the original model"
            )
        fused = fused_qat(module)
        if isinstance(module, WEIGHT_READING_PARENTS) or fused:  # fused ConvBn reads its BN
            for child_name, _ in module.named_modules():
                if child_name:
                    skip_children.setdefault(f"{name}.{child_name}" if name else child_name,
                                             "parent reads its weights directly")
        for path, why in source_weight_readers(module).items():
            skip_children.setdefault(f"{name}.{path}" if name else path, why)
        wrapper = wrapper_for(method, module) if name else None
        if wrapper is None:
            continue
        why = "" if getattr(wrapper, "runs_base_hooks", False) else fused or hooked(module)
        if why:
            plan.skipped[name] = why
            continue
        if name in skip_children:
            plan.skipped[name] = skip_children[name]
            continue
        candidates.append(name)
    read = {n: why for n, why in plan.skipped.items() if "instead of calling it" in why}
    if read:
        first = next(iter(read))
        logger.info("%d layer(s) get no posterior: their parent computes with their weights "
                    "instead of calling them, which would bypass a wrapper (e.g. %r: %s)",
                    len(read), first, read[first])

    modules = dict(model.named_modules())
    selected = _apply_preset(model, config.targets, candidates, modules, method)
    if config.include:
        _check_explicit(config.include, modules, method)
        selected = [n for n in selected if _matches_any(n, config.include)]
    if config.exclude:
        selected = [n for n in selected if not _matches_any(n, config.exclude)]
    if not selected:
        supported = ", ".join(getattr(t, "display_name", t.__name__) for t in method.wrappers)
        common = ", ".join(f"{t}×{c}" for t, c in plan.seen_types.most_common(12))
        none = ("" if candidates else
                f"; the model has no layer {method.name!r} can wrap: use another family "
                "(e.g. 'ibnn' or 'laplace', which wrap Linear and convolution layers)")
        if plan.skipped:
            first = next(iter(plan.skipped))
            none += (f"; {len(plan.skipped)} layer(s) of those types skipped, e.g. {first!r}: "
                     f"{plan.skipped[first]}")
        raise BayesifyError(
            f"no layer matched for method {method.name!r} (targets={config.targets!r}, "
            f"include={list(config.include)}, exclude={list(config.exclude)}); "
            f"supported types: {supported}; {len(candidates)} supported layer(s) seen "
            f"(e.g. {candidates[:5]}); module types seen: {common}{none}"
        )
    plan.targets = selected
    aliases = module_aliases(model)
    plan.aliases = {n: aliases[n] for n in selected if n in aliases}
    return plan


def _apply_preset(
    model: nn.Module,
    targets: object,
    candidates: list[str],
    modules: dict[str, nn.Module],
    method: Method,
) -> list[str]:
    if targets in (None, "all"):
        return list(candidates)
    if targets == "last_layer":
        head = find_classifier(model)
        if head is None:
            raise BayesifyError(
                f"targets='last_layer' needs the model's classifier, a Linear layer; "
                f"{type(model).__name__} has none (e.g. a convolutional classifier, as "
                f"SqueezeNet's): name a layer {method.name!r} supports with targets=[...], or "
                "use a family that wraps every layer (e.g. 'ibnn', 'swag')"
            )
        if head not in candidates:
            raise BayesifyError(
                f"targets='last_layer' but the classifier {head!r} is not a layer "
                f"{method.name!r} supports; name one explicitly with targets=[...]"
            )
        if getattr(method, "every_classifier", False):
            heads = classifier_group(model)
            if len(heads) > 1 and all(h in candidates for h in heads):
                logger.info("targets='last_layer': the model's logits combine %d classifiers "
                            "(a distilled model's heads): %s", len(heads), heads)
                return heads
        return [head]
    if isinstance(targets, str) and re.fullmatch(r"(first|last):\d+", targets):
        which, k = targets.split(":")
        k = int(k)
        if k <= 0:
            raise BayesifyError(f"targets={targets!r}: K must be positive")
        return candidates[:k] if which == "first" else candidates[-k:]
    if isinstance(targets, str):
        raise BayesifyError(
            f"unknown targets preset {targets!r}; use 'all', 'last_layer', 'first:K', "
            "'last:K' or a list of module names/patterns"
        )
    if not isinstance(targets, (list, tuple, set, frozenset)) or not all(
        isinstance(t, str) for t in targets
    ):
        raise TypeError(
            f"targets must be a preset ('all', 'last_layer', 'first:K', 'last:K') or a list "
            f"of module names / regex patterns (str); got {targets!r} ({type(targets).__name__})"
        )
    patterns = list(targets)  # explicit list of names / patterns
    _check_explicit(patterns, modules, method)
    _check_every_pattern_matches(patterns, candidates, modules, method)
    return [n for n in candidates if _matches_any(n, patterns)]


def _check_every_pattern_matches(patterns: list[str], candidates: list[str],
                                 modules: dict[str, nn.Module], method: Method) -> None:
    """A listed target that selects nothing is a typo or a stale name: refuse it."""
    names = [n for n in modules if n]
    for pattern in patterns:
        if any(name_matches(n, pattern) for n in candidates):
            continue
        matched = [n for n in names if name_matches(n, pattern)]
        if matched:
            types = sorted({type(modules[n]).__name__ for n in matched})
            supported = ", ".join(t.__name__ for t in method.wrappers)
            raise BayesifyError(
                f"targets entry {pattern!r} matches {matched[:5]} of type(s) {types}, none of "
                f"which method {method.name!r} can wrap here (supported: {supported}; a layer "
                "whose parent reads its weights directly is skipped)"
            )
        close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.5)
        hint = f"close matches: {close}" if close else f"module names look like {names[:5]}"
        raise BayesifyError(
            f"targets entry {pattern!r} matches no module of the model; {hint}"
        )


def _check_explicit(patterns: Iterable[str], modules: dict[str, nn.Module], method: Method) -> None:
    """An explicitly named module of an unsupported type is an error, not a no-op."""
    for pattern in patterns:
        module = modules.get(pattern)
        if module is not None and pattern and wrapper_for(method, module) is None:
            supported = ", ".join(t.__name__ for t in method.wrappers)
            raise BayesifyError(
                f"module {pattern!r} is a {type(module).__name__}, which method "
                f"{method.name!r} cannot wrap; supported types: {supported}"
            )


def replace_modules(model: nn.Module, replacements: dict[str, nn.Module]) -> None:
    """Install ``replacements`` (qualified name → new module) into ``model``.

    A module registered under several names is replaced under all of them by the
    same new module, so no path to it bypasses the wrapper.
    """
    aliases = module_aliases(model)
    for name, new in replacements.items():
        for alias in (name, *aliases.get(name, ())):
            parent_name, _, attr = alias.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, new)



def bypass_fused_paths(model: nn.Module) -> None:
    """Keep PyTorch's fused inference kernels away from modules that contain wrappers.

    In eval mode without gradients ``nn.TransformerEncoderLayer`` computes the whole block
    from ``linear1.weight`` … in one fused call, and ``nn.TransformerEncoder`` packs padded
    batches into nested tensors for it: a wrapper's forward (its noise, its members) is
    skipped — a silent mean network for families with a mean weight, an ``AttributeError``
    for the others. Two flags that only choose those kernels (``activation_relu_or_gelu``
    of the layer, ``use_nested_tensor`` of the stack) are turned off where a wrapper sits
    inside; what the block computes is unchanged.
    """
    def wraps(module: nn.Module) -> bool:
        return any(isinstance(m, BayesianLayer) for m in module.modules())

    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and wraps(module):
            module.activation_relu_or_gelu = 0
        elif isinstance(module, nn.TransformerEncoder) and wraps(module):
            module.use_nested_tensor = False
