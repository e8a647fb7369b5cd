"""Adding a family touches its own folder and one registry line (CONTRIBUTING.md).

``scalenoise`` is written here the way a new ``bayesify/methods/scalenoise/`` folder
would be — a config, a layer, a method with a step — from the core, the kit and nothing
else; ``register_method`` stands in for the registry line. The registry-wide checks are
then run on it unchanged: every test function of ``test_registry_shared`` and
``test_registry_state`` parametrised over ``list_methods()`` is found and called with
``method="scalenoise"`` (no list of families to update by hand), followed by
fit-with-validation (the knob search), save/load and export.

The family: every target Linear/Conv output channel is multiplied by ``1 + σ_c·z``,
``z ~ N(0, 1)`` drawn through the sampling context (per row in training, per member at
prediction), ``σ = softplus(ρ)``, prior ``N(1, s²)`` on the multiplier: a one-component
cousin of iBNN acting after the layer instead of before it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayesify
from bayesify.core import registry
from bayesify.core.config import MethodConfig, option, require
from bayesify.core.context import SamplingContext
from bayesify.core.fitting import Step
from bayesify.core.layers import BayesianLayer, broadcast_rows, channel_axis, out_channels
from bayesify.core.method import wrapper_table
from bayesify.kit.family import NoiseFamily
from bayesify.kit.gaussian import gaussian_kl, inverse_softplus
from bayesify.kit.knobs import SpreadKnob, knob_value
from bayesify.kit.steps import ElboStep, RoundRobin
from bayesify.predict.export import build_exported_predictor
from tests import test_registry_shared, test_registry_state

NAME = "scalenoise"


# -- bayesify/methods/scalenoise/config.py ----------------------------------------------
@dataclass(frozen=True)
class ScaleNoiseConfig(MethodConfig):
    init_std: float = option(0.05, "σ at initialisation (std of the output multiplier).")
    prior_std: float = option(0.1, "s: std of the prior N(1, s²) on every multiplier.")
    samples: int = option(1, "Training repeats of every example (each with its own noise).")
    predict_samples: int = option(4, "M: members at prediction.")

    def validate(self) -> None:
        require(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")
        require(self.prior_std > 0, f"prior_std must be > 0, got {self.prior_std}")


# -- bayesify/methods/scalenoise/layers.py ----------------------------------------------
class ScaleNoiseLayer(BayesianLayer):
    """``out = base(x) ∘ (1 + knob·σ ∘ z)`` per output channel; ``ρ [C_out]``."""

    def __init__(self, base_layer: nn.Module, *, context: SamplingContext,
                 config: ScaleNoiseConfig) -> None:
        super().__init__(base_layer, context)
        self.axis = channel_axis(base_layer)
        channels = out_channels(base_layer)
        init = torch.full((channels,), config.init_std)
        self.rho = nn.Parameter(inverse_softplus(init).to(base_layer.weight.dtype))
        self.prior_std = config.prior_std

    def mean_weight(self, name: str) -> torch.Tensor | None:
        return getattr(self.base_layer, name)  # E[1 + σz] = 1: the base layer is the mean

    def num_nodes(self) -> int:
        return self.rho.numel()

    def kl(self) -> torch.Tensor:
        """KL(N(1, σ²) ‖ N(1, s²)) summed over channels."""
        var = F.softplus(self.rho.float()).square()
        return gaussian_kl(torch.ones_like(var), var, 1.0, self.prior_std).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.context.deterministic:
            return out
        z = self.context.draw(self.layer_id, out.shape[0], (self.rho.numel(),), out.device)
        scale = 1 + knob_value(self) * F.softplus(self.rho).float() * z
        return out * broadcast_rows(scale.to(out.dtype), out, self.axis)


# -- bayesify/methods/scalenoise/method.py ----------------------------------------------
class ScaleNoiseMethod(SpreadKnob, NoiseFamily):
    """Output-channel scale noise; ELBO step, spread knob, frozen-noise export (kit)."""

    name = NAME
    config_cls = ScaleNoiseConfig
    knob = "scalenoise_std_scale"
    knob_meaning = "multiplier of the learned multiplier std; 0 = the base network"
    wrappers: ClassVar = wrapper_table(ScaleNoiseLayer)

    def step(self) -> Step:
        return ElboStep(RoundRobin(self.config.samples, self.components), lr=0.05)


# -- the registry line, for the duration of a test ----------------------------------------
@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(registry._METHODS, NAME, f"{__name__}:ScaleNoiseMethod")
    yield NAME


def registry_wide_checks() -> list[tuple[str, object, dict]]:
    """Every test of the registry modules parametrised over ``list_methods()``, with the
    first value of each of its other parameters."""
    found = []
    for module in (test_registry_shared, test_registry_state):
        for name, fn in sorted(vars(module).items()):
            if not name.startswith("test_") or not callable(fn):
                continue
            params = {}
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "parametrize":
                    params[mark.args[0]] = list(mark.args[1])
            if params.get("method") != module.METHODS:  # list_methods() at collection
                continue  # not registry-wide (e.g. a check of two named families)
            others = {k: v[0] for k, v in params.items() if k != "method"}
            found.append((f"{module.__name__.rpartition('.')[2]}.{name}", fn, others))
    return found


def test_the_registry_wide_checks_pass_for_a_new_family(registered, tmp_path_factory):
    checks = registry_wide_checks()
    assert len(checks) >= 5, [c[0] for c in checks]
    for label, fn, others in checks:
        kwargs = dict(others, method=registered)
        if "tmp_path" in inspect.signature(fn).parameters:
            kwargs["tmp_path"] = tmp_path_factory.mktemp(label.replace(".", "_"))
        fn(**kwargs)


def test_a_new_family_fits_tunes_saves_and_exports(registered, tmp_path):
    assert registered in bayesify.list_methods()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 3)).eval()
    x, y = torch.randn(32, 1, 6, 6), torch.randint(0, 3, (32,))
    train = DataLoader(TensorDataset(x, y), batch_size=8)
    bnn = bayesify.bayesify(net, registered)
    result = bayesify.fit(bnn, train, val_loader=train, epochs=2, progress=False, seed=0)
    knob = ScaleNoiseMethod.knob
    assert result.last[knob] in result.last[f"{knob}_grid"]
    assert result.last["kl"] > 0
    predictor = bnn.predictor()
    before = predictor(x[:5])
    assert before.member_probs.shape == (4, 5, 3)
    bnn.save_posterior(tmp_path / "post")
    again = bayesify.load_posterior(net, tmp_path / "post")
    assert torch.equal(again.predictor()(x[:5]).probs, before.probs)
    module = build_exported_predictor(predictor, x[:2])
    with torch.no_grad():
        probs, _ = module(x[:5])
    torch.testing.assert_close(probs, before.probs, atol=1e-5, rtol=1e-5)
