"""Export: frozen samples + temperature in a plain module that needs torch only."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import ClassVar

import numpy as np
import pytest
import torch

from bayesify import BayesifyError, ModelPredictor, bayesify
from bayesify.core import registry
from bayesify.methods.ibnn.layers import NodeNoiseLayer
from bayesify.methods.ibnn.method import IBNNMethod
from bayesify.predict.export import build_exported_predictor, run_exported


def _assert_matches(predictor, probs, epistemic, x, atol=1e-5):
    reference = predictor(x)
    torch.testing.assert_close(probs, reference.probs, atol=atol, rtol=0)
    torch.testing.assert_close(epistemic, reference.epistemic, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def digits_export(digits, digits_map, tmp_path_factory):
    """An iBNN predictor on the digits CNN (T ≠ 1) exported once as .pt2."""
    torch.manual_seed(0)
    bnn = bayesify(digits_map, "ibnn", components=2, init_mean_std=0.3)
    predictor = bnn.predictor(samples_per_component=2, seed=3)
    predictor.temperature = 0.7
    path = tmp_path_factory.mktemp("export") / "digits.pt2"
    info = predictor.export(path, digits.val.tensors[0][:2])
    return predictor, path, info


def test_pt2_matches_in_process_for_any_batch_size(digits, digits_export):
    predictor, path, info = digits_export
    assert info["members"] == 4 and info["temperature"] == 0.7 and info["max_abs_diff"] <= 1e-5
    for batch in (1, 5, 33):  # the example had 2 rows: the batch axis is dynamic
        x = digits.test.tensors[0][:batch]
        probs, epistemic = run_exported(path, x)
        assert probs.shape == (batch, 5) and epistemic.shape == (batch,)
        _assert_matches(predictor, probs, epistemic, x)
    # members really differ (noise frozen per member, not averaged away)
    assert predictor(digits.test.tensors[0][:33]).epistemic.max() > 1e-4


def test_pt2_loads_in_a_process_without_bayesify(digits, digits_export, tmp_path):
    predictor, path, _ = digits_export
    x = digits.test.tensors[0][:9]
    np.save(tmp_path / "x.npy", x.numpy())
    script = textwrap.dedent(f"""
        import sys
        sys.modules["bayesify"] = None  # any import of bayesify now fails
        import numpy as np, torch
        module = torch.export.load({str(path)!r}).module()
        probs, epistemic = module(torch.from_numpy(np.load({str(tmp_path / 'x.npy')!r})))
        np.save({str(tmp_path / 'probs.npy')!r}, probs.detach().numpy())
        np.save({str(tmp_path / 'mi.npy')!r}, epistemic.detach().numpy())
        assert not any(m.startswith("bayesify.") for m in sys.modules), "bayesify was imported"
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=120)
    probs = torch.from_numpy(np.load(tmp_path / "probs.npy"))
    epistemic = torch.from_numpy(np.load(tmp_path / "mi.npy"))
    _assert_matches(predictor, probs, epistemic, x)


def test_onnx_matches_in_process(digits, digits_export, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    predictor, _, _ = digits_export
    path = tmp_path / "digits.onnx"
    info = predictor.export(path, digits.val.tensors[0][:2], format="onnx")
    assert info["max_abs_diff"] <= 1e-5
    x = digits.test.tensors[0][:17]
    probs, epistemic = run_exported(path, x)
    _assert_matches(predictor, probs, epistemic, x)


def test_timm_resnet18_pt2_matches_in_process(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=4).eval()
    predictor = bayesify(model, "ibnn", components=2).predictor(samples_per_component=1)
    predictor.temperature = 1.3
    # export() reloads the saved file and compares it with the predictor on the example
    info = predictor.export(tmp_path / "resnet18.pt2", torch.randn(3, 3, 32, 32), atol=1e-5)
    assert info["members"] == 2 and 0 <= info["max_abs_diff"] <= 1e-5


def test_map_predictor_exports_softmax_with_zero_epistemic(digits, digits_map):
    predictor = ModelPredictor(digits_map, temperature=2.0)
    x = digits.test.tensors[0][:6]
    module = build_exported_predictor(predictor, x)
    with torch.no_grad():
        probs, epistemic = module(x)
        expected = (digits_map(x) / 2.0).softmax(-1)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    assert epistemic.abs().max() < 1e-6


class OverridingMethod(IBNNMethod):
    """Predicts through its own member_logits: the default export cannot know it."""

    name = "export_test_override"

    def member_logits(self, bnn, x, **kwargs):
        return super().member_logits(bnn, x, **kwargs)


class RawNoiseLayer(NodeNoiseLayer):
    """Draws its noise with torch.randn instead of the sampling context."""

    def sample_noise(self, rows, device):
        comp = self.context.components_for(rows, device)
        mean = self.mean.index_select(0, comp)
        return mean + self.std.index_select(0, comp) * torch.randn_like(mean)


class RawNoiseMethod(IBNNMethod):
    name = "export_test_raw"
    wrappers: ClassVar = {torch.nn.Linear: RawNoiseLayer, torch.nn.Conv2d: RawNoiseLayer}


class BranchingLayer(NodeNoiseLayer):
    """Python control flow on tensor values: torch.export cannot trace it."""

    def forward(self, x, *args, **kwargs):
        comp = self.context.components_for(x.shape[0], x.device)
        if int(torch.unique(comp).numel()) > 1:
            x = x * 1.0
        return super().forward(x, *args, **kwargs)


class BranchingMethod(IBNNMethod):
    name = "export_test_branching"
    wrappers: ClassVar = {torch.nn.Linear: BranchingLayer, torch.nn.Conv2d: BranchingLayer}


@pytest.mark.parametrize(("cls", "message"), [
    (OverridingMethod, "overrides member_logits"),
    (RawNoiseMethod, "draws random numbers"),
    (BranchingMethod, "torch.export could not trace"),
])
def test_families_the_default_cannot_express_are_refused(cls, message, digits, digits_map,
                                                         monkeypatch, tmp_path):
    monkeypatch.setitem(registry._METHODS, cls.name, f"{cls.__module__}:{cls.__qualname__}")
    predictor = bayesify(digits_map, cls.name, components=2).predictor(samples_per_component=1)
    with pytest.raises(BayesifyError, match=message) as err:
        predictor.export(tmp_path / "x.pt2", digits.val.tensors[0][:2])
    assert cls.name in str(err.value)
    assert not (tmp_path / "x.pt2").exists()


def test_unknown_format_is_refused(digits, digits_export, tmp_path):
    predictor, _, _ = digits_export
    with pytest.raises(BayesifyError, match="unknown export format"):
        predictor.export(tmp_path / "x.tflite", digits.val.tensors[0][:2], format="tflite")


def test_eval_batchnorm_traces_as_an_affine_map_with_the_same_predictions(digits, tmp_path):
    """On CUDA the export traces BatchNorm as x·s + t (ATen's cuDNN size checks become guards a
    dynamic batch cannot honour); forced on here, on the CPU: same predictions, no batch_norm."""
    import torchvision

    from bayesify.predict.export import EvalBatchNormAsAffine, export_program

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=5).eval()
    for m in net.modules():  # non-trivial running statistics and affine parameters
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        plain = net(x)
        with EvalBatchNormAsAffine():
            torch.testing.assert_close(net(x), plain, atol=1e-5, rtol=1e-5)
    predictor = bayesify(net, "ibnn", components=2).predictor(samples_per_component=1, seed=0)
    module = build_exported_predictor(predictor, x[:2])
    for affine in (False, True):
        program = export_program(module, x[:2], batchnorm_as_affine=affine)
        ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        assert any("batch_norm" in op for op in ops) != affine, sorted(ops)
        probs, epistemic = program.module()(x)
        reference = predictor(x)
        torch.testing.assert_close(probs, reference.probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(epistemic, reference.epistemic, atol=1e-5, rtol=0)
