"""Plan → validate → replace: choose the layers that receive a posterior.

Targets are chosen by an explicit type table of the method (isinstance) plus
presets and include/exclude patterns on qualified module names, like PEFT's
``target_modules``. Nothing is modified until the whole plan is valid.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from bayesify.core.layers import BayesianLayer
from bayesify.core.method import Method
from bayesify.errors import BayesifyError

#: parents that read a child's weights directly instead of calling it: a wrapper
#: around such a child would be bypassed silently, so these children are skipped.
WEIGHT_READING_PARENTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


@dataclass
class TargetPlan:
    """Result of planning: the names to wrap, and what was seen and skipped why."""

    targets: list[str]
    skipped: dict[str, str] = field(default_factory=dict)
    seen_types: Counter = field(default_factory=Counter)


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


def find_classifier(model: nn.Module) -> str | None:
    """Qualified name of the classifier: timm ``get_classifier()`` or the last Linear."""
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier):
        try:
            head = get_classifier()
        except Exception:  # noqa: BLE001 - some models raise when headless
            head = None
        if isinstance(head, nn.Module):
            for name, module in model.named_modules():
                if module is head:
                    if isinstance(head, (nn.Linear, nn.modules.conv._ConvNd)):
                        return name
                    last = [n for n, m in head.named_modules() if isinstance(m, nn.Linear)]
                    if last:
                        return f"{name}.{last[-1]}" if name else last[-1]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def plan_targets(model: nn.Module, method: Method) -> TargetPlan:
    """Compute (without modifying anything) the qualified names to wrap."""
    config = method.config
    plan = TargetPlan(targets=[])
    skip_children: set[str] = set()
    candidates: list[str] = []
    for name, module in model.named_modules():
        plan.seen_types[type(module).__name__] += 1
        if isinstance(module, BayesianLayer):
            raise BayesifyError(
                f"the model is already bayesified (module {name!r} is a "
                f"{type(module).__name__}); call .unwrap() first or wrap the original model"
            )
        if isinstance(module, WEIGHT_READING_PARENTS):
            for child_name, _ in module.named_modules():
                if child_name:
                    skip_children.add(f"{name}.{child_name}" if name else child_name)
        if not name or not method.supports(module):
            continue
        if name in skip_children:
            plan.skipped[name] = "parent reads its weights directly"
            continue
        candidates.append(name)

    modules = dict(model.named_modules())
    selected = _apply_preset(model, config.targets, candidates, modules, method)
    if config.include:
        _check_explicit(config.include, modules, method)
        selected = [n for n in selected if _matches_any(n, config.include)]
    if config.exclude:
        selected = [n for n in selected if not _matches_any(n, config.exclude)]
    if not selected:
        supported = ", ".join(t.__name__ for t in method.wrappers)
        common = ", ".join(f"{t}×{c}" for t, c in plan.seen_types.most_common(12))
        raise BayesifyError(
            f"no layer matched for method {method.name!r} (targets={config.targets!r}, "
            f"include={list(config.include)}, exclude={list(config.exclude)}); "
            f"supported types: {supported}; {len(candidates)} supported layer(s) seen "
            f"(e.g. {candidates[:5]}); module types seen: {common}"
        )
    plan.targets = selected
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
        if head is None or head not in candidates:
            raise BayesifyError(
                f"targets='last_layer' but no supported classifier was found "
                f"(found {head!r}); name it explicitly with targets=[...]"
            )
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
    patterns = list(targets)  # explicit list of names / patterns
    _check_explicit(patterns, modules, method)
    return [n for n in candidates if _matches_any(n, patterns)]


def _check_explicit(patterns: Iterable[str], modules: dict[str, nn.Module], method: Method) -> None:
    """An explicitly named module of an unsupported type is an error, not a no-op."""
    for pattern in patterns:
        module = modules.get(pattern)
        if module is not None and pattern and not method.supports(module):
            supported = ", ".join(t.__name__ for t in method.wrappers)
            raise BayesifyError(
                f"module {pattern!r} is a {type(module).__name__}, which method "
                f"{method.name!r} cannot wrap; supported types: {supported}"
            )


def replace_modules(model: nn.Module, replacements: dict[str, nn.Module]) -> None:
    """Install ``replacements`` (qualified name → new module) into ``model``."""
    for name, new in replacements.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
