"""``bayesify(model, method=..., **options)``: the one entry point."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

from torch import nn

from bayesify.core.config import HEADS_BY_DEFAULT, MethodConfig
from bayesify.core.context import SamplingContext
from bayesify.core.digests import architecture_record, tensor_digests
from bayesify.core.model import BayesianModel
from bayesify.core.outputs import OutputFn, install_output_fn, resolve_output_fn
from bayesify.core.registry import get_method_class
from bayesify.core.walker import (
    bypass_fused_paths,
    find_classifier,
    plan_targets,
    replace_modules,
)
from bayesify.errors import BayesifyError

logger = logging.getLogger(__name__)


def bayesify(
    model: nn.Module,
    method: str = "ibnn",
    *,
    config: MethodConfig | None = None,
    inplace: bool = False,
    freeze_base: bool = True,
    output_fn: OutputFn | None = None,
    **options: Any,
) -> BayesianModel:
    """Inject a posterior of family ``method`` around the target layers of ``model``.

    ``options`` are fields of the family's config (see ``describe_method``); pass
    a ready ``config`` instead to reuse one. The caller's model is deep-copied
    unless ``inplace=True`` and is never left half-modified: targets are planned
    and every wrapper is built before anything is replaced.

    ``output_fn``: which part of the model's output holds the class logits when it
    is not a ``[B, C]`` tensor or a ``ModelOutput`` with ``.logits`` — an index
    (``output_fn=1`` for ``(features, logits)``), an attribute / key name, or a
    function; see :mod:`bayesify.core.outputs`. A tuple output without it is refused.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"bayesify expects a torch.nn.Module, got {type(model).__name__}")
    model = parallel_module(model)
    if isinstance(model, BayesianModel):
        raise BayesifyError(
            "the model is already bayesified (a BayesianModel); call .unwrap() to get "
            "the base network back, or pass the original model"
        )
    resolve_output_fn(output_fn)  # a bad output_fn is refused before anything changes
    method_cls = get_method_class(method)
    heads_by_default = config is None and "laplace_heads" not in options
    if config is None:
        config = method_cls.config_cls.from_kwargs(method, options)
    elif options:
        raise BayesifyError("pass either config=... or keyword options, not both")
    elif not isinstance(config, method_cls.config_cls):
        raise BayesifyError(
            f"config is a {type(config).__name__}; method {method!r} needs "
            f"{method_cls.config_cls.__name__}"
        )
    # a family whose members are not a Linear classifier of readable features declares why
    # (``laplace_heads_unsupported`` on the class; bayesify.kit.laplace_heads)
    unsupported = getattr(method_cls, "laplace_heads_unsupported", "")
    if getattr(config, "laplace_heads", False) and unsupported:
        raise BayesifyError(
            f"laplace_heads=True is not available for method {method!r}: its predictive "
            f"members are not a Linear classifier on features the heads could read "
            f"({unsupported}). Use it without laplace_heads, or a "
            "family that has them (every family but laplace, which is one)")
    config, heads_off = _heads_need_a_classifier(model, method, config,
                                                 by_default=heads_by_default)
    family = method_cls(config)
    plan = plan_targets(model, family)  # validates; raises before any change
    if heads_off:
        logger.warning(heads_off)

    # every wrapper and extra module is built before the first setattr, so a failed
    # call leaves the caller's model untouched (inplace=True included)
    digests = tensor_digests(model.state_dict())
    architecture = architecture_record(model)
    target_model = model if inplace else copy.deepcopy(model)
    requires_grad = {n: p.requires_grad for n, p in target_model.named_parameters()}
    context = SamplingContext(family.components)
    modules = family.build(target_model, list(plan.targets), context)
    missing = [name for name in plan.targets if name not in modules]
    if missing:
        raise BayesifyError(f"method {method!r} built no wrapper for target(s) {missing[:3]}")
    replace_modules(target_model, modules)
    bypass_fused_paths(target_model)  # a fused transformer kernel would skip the wrappers
    install_output_fn(target_model, output_fn)

    bnn = BayesianModel(
        target_model,
        method=family,
        context=context,
        targets=plan.targets,
        base_requires_grad=requires_grad,
        skipped=plan.skipped,
        base_digests=digests,
    )
    bnn.base_architecture = architecture  # what the base computes (save_posterior records it)
    if freeze_base:
        bnn.set_base_trainable(False)
    bnn.runtime[HEADS_BY_DEFAULT] = heads_by_default and bool(getattr(config, "laplace_heads",
                                                                       False))
    family.prepare(bnn)
    return bnn


def parallel_module(model: nn.Module) -> nn.Module:
    """The network inside an ``nn.DataParallel`` / ``DistributedDataParallel`` wrapper (a
    checkpoint loaded as it was trained) or ``torch.compile``'s ``OptimizedModule``, logged;
    any other module as it is. The wrapper
    adds nothing bayesify needs (``fit`` runs data-parallel under ``torchrun`` itself), and
    torch's functional calls refuse it (SWAG failed mid-fit: "The stateless API can't be
    used with nn.DataParallel module"). The posterior is then the inner network's: save,
    load and export it with the inner network (``load_posterior`` unwraps the same way)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
            logger.info("bayesify: %s wraps the network; its .module (%s) is used",
                        type(model).__name__, type(model.module).__name__)
            model = model.module
        elif _compiled(model):
            logger.info("bayesify: torch.compile wraps the network; the network it compiled "
                        "(%s) is used (compile the predictor's network again if you want it "
                        "compiled)", type(model._orig_mod).__name__)
            model = model._orig_mod
        else:
            return model


def _compiled(model: nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper (``OptimizedModule``): its parameter
    names carry ``_orig_mod.``, so a posterior fitted through it would not load onto the
    network it compiled, and every member forward recompiled (a 16 s fit of a 3-layer MLP)."""
    return type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), nn.Module)


def _heads_need_a_classifier(model: nn.Module, method: str, config: MethodConfig, *,
                             by_default: bool) -> tuple[MethodConfig, str]:
    """``config``, without its member-wise Laplace heads where the model has no Linear
    classifier for them to sit on (a convolutional classifier, as SqueezeNet's), and the
    sentence that says so: on by the family's default, they are turned off; asked for
    (``laplace_heads=True`` or a ``config``), that is an error now, not after the fit."""
    if not getattr(config, "laplace_heads", False) or find_classifier(model) is not None:
        return config, ""
    if not by_default:
        raise BayesifyError(
            f"laplace_heads=True needs a Linear classifier whose output is the model's "
            f"logits; {type(model).__name__} has no Linear layer (e.g. a convolutional "
            f"classifier, as SqueezeNet's). Use bayesify(model, {method!r}, "
            "laplace_heads=False)")
    return dataclasses.replace(config, laplace_heads=False), (
        f"bayesify: {type(model).__name__} has no Linear classifier (e.g. a convolutional "
        f"one), so {method!r} predicts without its member-wise Laplace heads "
        "(laplace_heads=False; their spread that grows off the data needs a Linear head)")
