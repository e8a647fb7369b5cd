"""Model outputs are read by one documented rule, never guessed (bayesify.core.outputs).

``(features, logits)`` needs ``output_fn=``; per-pixel / per-token maps, one output per
example, fewer than two classes and softmax outputs are clear errors at ``fit`` and at
the predictor; ``output_fn`` (index, name or function) is honoured by every family
and round-trips through ``save_posterior`` / ``load_posterior``.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, ModelOutputError, bayesify, fit, load_posterior
from bayesify.core.method import logits_of as reexported
from bayesify.core.outputs import logits_of

x_all = torch.randn(48, 6, generator=torch.Generator().manual_seed(0))
y_all = (x_all[:, 0] > 0).long() + (x_all[:, 1] > 0.5).long()
LOADER = DataLoader(TensorDataset(x_all, y_all), batch_size=16)


class Net(nn.Module):
    """``features → logits``; ``mode`` decides what ``forward`` returns."""

    def __init__(self, mode: str = "logits", classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.head = nn.Linear(16, classes)
        self.mode = mode

    def forward(self, x):
        features = self.body(x)
        logits = self.head(features)
        return {
            "logits": logits,
            "pair": (features, logits),
            "list1": [logits],
            "dict": {"features": features, "logits": logits},
            "softmax": logits.softmax(-1),
            "pixels": logits[:, :, None, None].expand(-1, -1, 4, 4),
            "tokens": logits[:, None, :].expand(-1, 5, -1),
            "flat": logits[:, 0],
        }[self.mode]


def test_logits_of_is_reexported_from_core_method():
    assert reexported is logits_of


@pytest.mark.parametrize(("mode", "match"), [
    ("pair", r"tuple of 2 \(\[.*16\], \[.*3\]\).*output_fn=1.*lambda out: out\[1\]"),
    ("pixels", r"\[B, C, H, W\]"),
    ("tokens", r"per-pixel or per-token"),
    ("flat", r"at least 2 classes"),
])
def test_unreadable_outputs_are_clear_errors_at_fit_and_prediction(mode, match):
    bnn = bayesify(Net(mode), "ibnn")
    before = {n: p.clone() for n, p in bnn.named_posterior_parameters()}
    with pytest.raises(ModelOutputError, match=match) as info:
        fit(bnn, LOADER, progress=False)
    assert isinstance(info.value, BayesifyError) and isinstance(info.value, TypeError)
    assert all(torch.equal(before[n], p) for n, p in bnn.named_posterior_parameters())
    with pytest.raises(ModelOutputError, match=match):
        bnn.predictor()(x_all[:4])


def test_a_one_class_model_is_refused():
    with pytest.raises(BayesifyError, match="at least 2 classes"):
        fit(bayesify(Net(classes=1), "ibnn"), LOADER, progress=False)


def test_softmax_outputs_are_refused_at_fit():
    with pytest.raises(BayesifyError, match="outputs probabilities"):
        fit(bayesify(Net("softmax"), "ibnn"), LOADER, progress=False)


@pytest.mark.parametrize(("mode", "output_fn"), [
    ("logits", None), ("list1", None), ("dict", None), ("pair", 1), ("pair", -1),
    ("dict", "logits"), ("pair", lambda out: out[1]),
])
def test_the_rule_and_output_fn_give_the_plain_model_s_predictive(mode, output_fn):
    def run(net, fn):
        torch.manual_seed(5)
        bnn = bayesify(net, "ibnn", components=2, output_fn=fn)
        fit(bnn, LOADER, progress=False, seed=1)
        return bnn.predictor()(x_all[:8]).probs

    assert torch.equal(run(Net(mode), output_fn), run(Net("logits"), None))


@pytest.mark.parametrize("method", ["laplace", "swag", "ensemble", "meanfield", "hypernet"])
def test_output_fn_works_for_weight_sampling_families(method):
    options = {"swag": {"max_rank": 2, "snapshot_every_steps": 1, "scale_method": "fixed"},
               "hypernet": {"targets": "last_layer"}}.get(method, {})

    def run(net, fn):
        torch.manual_seed(5)
        bnn = bayesify(net, method, output_fn=fn, **options)
        fit(bnn, LOADER, progress=False, seed=1, **({} if method == "laplace" else {"epochs": 2}))
        return bnn.predictor()(x_all[:8]).probs

    assert torch.allclose(run(Net("pair"), 1), run(Net("logits"), None), atol=1e-6)


@pytest.mark.parametrize("bad", [True, 1.5, object()])
def test_a_bad_output_fn_is_refused_before_anything(bad):
    net = Net("pair")
    with pytest.raises(TypeError, match="output_fn"):
        bayesify(net, "ibnn", output_fn=bad, inplace=True)
    assert not any("base_layer" in n for n, _ in net.named_modules())
    assert not net._forward_hooks


def test_a_named_output_fn_is_stored_and_reapplied(tmp_path):
    bnn = bayesify(Net("pair"), "ibnn", output_fn=1)
    fit(bnn, LOADER, progress=False, seed=1)
    bnn.save_posterior(tmp_path)
    assert json.loads((tmp_path / "bayesify.json").read_text())["output_fn"] == 1
    loaded = load_posterior(Net("pair"), tmp_path)
    assert torch.equal(loaded.predictor()(x_all[:4]).probs, bnn.predictor()(x_all[:4]).probs)
    with pytest.raises(BayesifyError, match="fitted with output_fn=1"):
        load_posterior(Net("pair"), tmp_path, output_fn=0)


def test_a_function_output_fn_must_be_passed_again_to_load(tmp_path):
    def second(out):
        return out[1]

    bnn = bayesify(Net("pair"), "ibnn", output_fn=second)
    bnn.save_posterior(tmp_path)
    recorded = json.loads((tmp_path / "bayesify.json").read_text())["output_fn"]
    assert recorded["callable"].endswith("second")
    with pytest.raises(BayesifyError, match="pass it again"):
        load_posterior(Net("pair"), tmp_path)
    loaded = load_posterior(Net("pair"), tmp_path, output_fn=second)
    assert torch.equal(loaded.predictor()(x_all[:4]).probs, bnn.predictor()(x_all[:4]).probs)


def test_hf_style_model_outputs_keep_working():
    class Output(OrderedDict):
        def __getattr__(self, name):
            return self[name]

    class HF(Net):
        def forward(self, x):
            return Output(logits=self.head(self.body(x)))

    bnn = bayesify(HF(), "ibnn")
    fit(bnn, LOADER, progress=False)
    assert bnn.predictor()(x_all[:4]).probs.shape == (4, 3)


@pytest.mark.parametrize("method", ["ibnn", "swag"])
def test_output_fn_reaches_the_validation_search_and_the_starting_network(method):
    """fit(val_loader=...) scores the unwrapped base and tunes the knob through output_fn."""
    options = {"swag": {"max_rank": 2, "snapshot_every_steps": 1}}.get(method, {})
    bnn = bayesify(Net("pair"), method, output_fn=1, **options)
    result = fit(bnn, LOADER, val_loader=LOADER, epochs=2, progress=False, seed=1)
    assert "start_val_nll" in result.history[0]
    assert bnn.unwrap()(x_all[:2]).shape == (2, 3)  # the unwrapped copy keeps the rule
