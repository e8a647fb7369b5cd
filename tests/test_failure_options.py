"""Bad options are refused before anything changes; good ones give finite results.

Property tests (hypothesis) draw values for every option of every family's config
and for ``fit``: valid ones, and the kinds a user gets wrong (NaN, inf, negative,
zero, ``True`` for a count, ``"0.1"`` for a number, 1.5 epochs). Each call either
works and yields finite outputs, or raises ``BayesifyError`` / ``ValueError`` /
``TypeError`` naming the option, with the caller's model untouched.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit, get_method_class, list_methods
from bayesify.core.config import check_field_types
from bayesify.train.options import FIT_OPTION_RULES, validate_fit_options

NAN, INF = float("nan"), float("inf")
#: BAYESIFY_HYPOTHESIS_EXAMPLES=500 for a longer, randomised search
EXAMPLES = int(os.environ.get("BAYESIFY_HYPOTHESIS_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 40,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
#: values users get wrong whatever the option
WRONG = [NAN, INF, -INF, -1, 0, True, False, "0.1", None, 1.5, [], -1e-3]


#: families that wrap normalisation layers only: their tiny model has a LayerNorm
NORM_FAMILIES = ("abnn",)


def tiny_model(norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if norm:
        return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)).eval()
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- configs

def value_strategy(hint: typing.Any) -> st.SearchStrategy:
    """Valid-looking and wrong values for a config field of type ``hint``."""
    wrong = st.sampled_from(WRONG)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        return st.one_of(*(value_strategy(h) for h in typing.get_args(hint) if h is not type(None)))
    if origin is tuple:
        element = st.one_of(st.floats(-2, 5), st.integers(-1, 4), st.sampled_from([NAN, "x"]))
        return st.one_of(st.lists(element, max_size=4).map(tuple), wrong)
    if hint is bool:
        return st.sampled_from([True, False, 0, 1, "yes", None])
    if hint is int:
        return st.one_of(st.integers(-2, 4), wrong)
    if hint is float:
        return st.one_of(st.floats(-3, 3), st.floats(1e-3, 10), wrong)
    if hint is str:
        return st.one_of(st.text(max_size=4), st.integers(0, 2), st.none())
    return wrong


def config_fields(method: str) -> dict[str, typing.Any]:
    cls = get_method_class(method).config_cls
    hints = typing.get_type_hints(cls)
    skip = {"targets", "include", "exclude"}  # module selection: the walker's tests
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in skip}


@st.composite
def config_options(draw, method: str) -> dict[str, typing.Any]:
    fields = config_fields(method)
    names = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True))
    options = {}
    for name in names:
        default = get_method_class(method).config_cls.__dataclass_fields__[name].default
        keep_default = st.just(default)
        options[name] = draw(st.one_of(keep_default, value_strategy(fields[name])))
    return options


@pytest.mark.parametrize("method", list_methods())
def test_every_config_option_is_refused_clearly_or_works_finitely(method):
    base = tiny_model(norm=method in NORM_FAMILIES)
    before = snapshot(base)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))

    @SETTINGS
    @given(options=config_options(method))
    def check(options):
        try:
            bnn = bayesify(base, method, **options)
        except (BayesifyError, ValueError, TypeError) as err:
            assert any(name in str(err) for name in options), (options, str(err))
            assert f"method {method!r}" in str(err), str(err)  # names the family
        else:
            torch.manual_seed(0)
            assert torch.isfinite(bnn(x)).all(), options
            predictor = bnn.predictor()
            if not bnn.method.step().ready(bnn):  # a posterior only fit builds: refused
                with pytest.raises(BayesifyError, match="builds its posterior in bayesify.fit"):
                    predictor(x)
                predictor.during_fit = True  # the predictive fit's own validation sees
            probs = predictor(x).probs
            assert torch.isfinite(probs).all(), options
            assert torch.allclose(probs.sum(-1), torch.ones(6), atol=1e-4)
        assert same(snapshot(base), before)  # the caller's model: never touched
        assert all(type(m).__module__.startswith("torch.nn") for m in base.modules())

    check()


@pytest.mark.parametrize(("method", "options", "match"), [
    ("ibnn", {"prior_mean": NAN}, "prior_mean.*finite"),
    ("ibnn", {"prior_std": INF}, "prior_std.*finite"),
    ("ibnn", {"components": True}, "components.*integer.*bool"),
    ("ibnn", {"prior_std": "0.1"}, "prior_std.*number.*str"),
    ("ibnn", {"components": 2.0}, "components.*integer"),
    ("rank1", {"prior_mean": -INF}, "rank1.*prior_mean"),
    ("meanfield", {"prior_std": 0.0}, "prior_std must be > 0"),
    ("hypernet", {"mixture_std1": 0.0}, "mixture_std1 must be > 0"),
    ("meanfield", {"mixture_pi": NAN}, "mixture_pi.*finite"),
    ("laplace", {"prior_precision": INF}, "prior_precision.*finite"),
    ("laplace", {"val_grid": (1e-3, 1.0)}, "val_grid.*3 entries"),
    ("swag", {"max_rank": False}, "max_rank.*bool"),
    ("swag", {"scale": NAN}, "scale.*finite"),
    ("hypernet", {"hidden": (8, "16")}, r"hidden.*\[1\].*integer"),
    ("dropout", {"p": "0.5"}, ": p must be a number, got str"),
    ("ensemble", {"per_member_bn": 1}, "per_member_bn.*True or False"),
    ("batchensemble", {"components": 0}, "components must be a positive integer, got 0"),
])
def test_issue_config_cases_name_the_family_and_option(method, options, match):
    base = tiny_model()
    with pytest.raises((BayesifyError, TypeError), match=match) as info:
        bayesify(base, method, **options)
    assert f"method {method!r}" in str(info.value)


def test_direct_construction_is_checked_too():
    cls = get_method_class("ibnn").config_cls
    with pytest.raises(BayesifyError, match="IBNNConfig: prior_mean must be a finite number"):
        cls(prior_mean=NAN)
    config = cls(init_std=[0.1, 0.01])  # a list for a tuple field is normalised
    assert config.init_std == (0.1, 0.01)
    check_field_types(config)  # idempotent on a valid config


# --------------------------------------------------------------------------- fit

def fit_strategies() -> dict[str, st.SearchStrategy]:
    wrong = st.sampled_from(WRONG)
    small_count = st.one_of(st.integers(-1, 3), wrong)
    return {
        "epochs": st.one_of(st.integers(-1, 2), wrong),
        "lr": st.one_of(st.floats(1e-4, 0.5), wrong),
        "base_lr": st.one_of(st.floats(0, 1e-2), wrong),
        "kl_anneal_epochs": st.one_of(st.floats(0, 3), wrong),
        "beta": st.one_of(st.floats(0, 2), wrong),
        "momentum": st.one_of(st.floats(0, 0.95), st.just(1.0), wrong),
        "weight_decay": st.one_of(st.floats(0, 0.1), wrong),
        "base_weight_decay": st.one_of(st.floats(0, 0.1), wrong),
        "n_train": st.one_of(st.integers(-5, 500), wrong),
        "grad_accum_steps": small_count,
        "clip_grad_norm": st.one_of(st.floats(1e-3, 10), wrong),
        "checkpoint_every_steps": small_count,
        "keep_checkpoints": small_count,
        "val_every": small_count,
        "val_samples_per_component": small_count,
        "seed": st.one_of(st.integers(0, 100), st.just(-3), wrong),
        "optimizer": st.sampled_from(["sgd", "adam", "adamw", "SGD", "lbfgs", 3]),
        "lr_schedule": st.sampled_from(["constant", "cosine", "linear:0:1:0.5", "linear:1:0:0.5",
                                        "cosine:nan", ("linear", 0, 1, NAN), 3, "step"]),
        "amp": st.sampled_from([None, False, True, "yes", 1]),
        "channels_last": st.sampled_from([False, True, None, "no"]),
        "progress": st.sampled_from([False, 0, "off"]),
    }


FIT_STRATEGIES = fit_strategies()


@st.composite
def fit_options(draw) -> dict[str, typing.Any]:
    names = draw(st.lists(st.sampled_from(sorted(FIT_STRATEGIES)), min_size=1, max_size=2,
                          unique=True))
    return {name: draw(FIT_STRATEGIES[name]) for name in names}


def tiny_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize("method", ["ibnn", "meanfield"])
def test_every_fit_option_is_refused_clearly_or_trains_finitely(method):
    loader = tiny_data()

    @SETTINGS
    @given(options=fit_options())
    def check(options):
        torch.manual_seed(0)
        bnn = bayesify(tiny_model(), method, components=2) if method == "ibnn" else \
            bayesify(tiny_model(), method)
        before = snapshot(bnn)
        grads = {n: p.requires_grad for n, p in bnn.named_parameters()}
        call = {"progress": False, **options}
        try:
            result = fit(bnn, loader, **call)
        except (BayesifyError, ValueError, TypeError) as err:
            assert any(name in str(err) for name in options), (options, str(err))
            assert same(snapshot(bnn), before), options  # refused before anything changed
            assert grads == {n: p.requires_grad for n, p in bnn.named_parameters()}
        else:
            assert all(math.isfinite(r["loss"]) for r in result.history), options
            assert all(torch.isfinite(p).all() for p in bnn.parameters()), options

    check()


@pytest.mark.parametrize(("options", "match"), [
    ({"lr": NAN}, "lr must be a finite number > 0"),
    ({"lr": INF}, "lr must be a finite number > 0"),
    ({"lr": -0.1}, "lr must be a finite number > 0"),
    ({"clip_grad_norm": -1}, "clip_grad_norm must be a finite number > 0"),
    ({"n_train": -5}, "n_train must be positive"),
    ({"epochs": 1.5}, "epochs must be positive.*1.5 epochs is not a count"),
    ({"epochs": True}, "epochs must be positive.*bool"),
    ({"beta": NAN}, "beta must be a finite number >= 0"),
    ({"beta": -1.0}, "beta must be a finite number >= 0"),
    ({"grad_accum_steps": 0}, "grad_accum_steps must be positive"),
    ({"momentum": 1.0}, r"momentum must lie in \[0, 1\)"),
    ({"weight_decay": INF}, "weight_decay"),
    ({"keep_checkpoints": -1}, "keep_checkpoints must be an integer >= 0"),
    ({"checkpoint_every_steps": 0.5}, "checkpoint_every_steps must be an integer"),
    ({"val_every": 0}, "val_every must be positive"),
    ({"base_lr": "0.001"}, "base_lr must be a finite number >= 0, got str"),
    ({"lr_schedule": ("linear", 0, 1, NAN)}, "lr_schedule must hold finite numbers"),
])
def test_issue_fit_cases_are_refused_before_any_step(options, match):
    bnn = bayesify(tiny_model(), "ibnn", components=2)
    before = snapshot(bnn)
    with pytest.raises((BayesifyError, TypeError), match=match):
        fit(bnn, tiny_data(), progress=False, **options)
    assert same(snapshot(bnn), before)


def test_every_rule_names_its_option():
    for name, rule in FIT_OPTION_RULES.items():
        for bad in (NAN, "0.1", [1]):
            try:
                rule(name, bad)
            except (BayesifyError, TypeError) as err:
                assert name in str(err)
    validate_fit_options(epochs=2, lr=None, timeout_s=30, bnn=object(), method_kwargs={})
    with pytest.raises(BayesifyError, match="timeout_s"):
        validate_fit_options(timeout_s=0)
