"""The second quality protocol of benchmarks/protocols.py (a tiny ViT) builds, its shifts are
the transforms they say, and quality.py's seed files merge rows as documented."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

protocols = pytest.importorskip("protocols")
pytest.importorskip("timm")


def test_vit_protocol_builds_with_its_own_classes_shifts_and_ood():
    spec = protocols.PROTOCOLS["digits-vit"]
    p = spec.build(0)
    x, y = p.test.tensors
    assert p.num_classes == 8 and set(y.tolist()) == set(range(8))
    assert len(p.train) == 200 and p.ood_far.shape == (400, 1, 8, 8)
    assert p.ood_near.shape[1:] == (1, 8, 8) and torch.isfinite(p.ood_far).all()
    moved = spec.shifts(x, 0)
    assert tuple(moved) == spec.unseen and not spec.seen
    cnn = protocols.PROTOCOLS["digits-cnn"]
    assert not set(moved) & set(cnn.seen + cnn.unseen)  # other shifts than protocol 1
    for kind, xs in moved.items():
        assert xs.shape == x.shape and torch.isfinite(xs).all(), kind
        assert (xs - x).abs().mean() > 1e-3, kind  # every shift moves the images
    model = protocols.tiny_vit(p.num_classes).eval()
    with torch.no_grad():
        feats = model.forward_head(model.forward_features(x[:4]), pre_logits=True)
        assert feats.shape == (4, 32)
        torch.testing.assert_close(model.head(feats), model(x[:4]))
    assert any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())


def test_vit_shifts_are_the_transforms_they_name():
    x = torch.rand(3, 1, 8, 8)
    flat = torch.full((2, 1, 8, 8), 0.7)
    s = protocols.vit_shifts(flat, 0)
    torch.testing.assert_close(s["pixelate"], flat)  # a flat image has nothing to pixelate
    torch.testing.assert_close(s["brightness"], flat + 0.35)
    pix = protocols.vit_shifts(x, 0)["pixelate"]
    torch.testing.assert_close(pix[..., ::2, ::2], torch.nn.functional.avg_pool2d(x, 2))
    torch.testing.assert_close(protocols._elastic(x, 0, pixels=0.0), x, atol=1e-5, rtol=0)
    # a 1×5 horizontal box: interior pixels are the mean of their row's 5 neighbours
    blur = protocols.vit_shifts(x, 0)["motion_blur"]
    torch.testing.assert_close(blur[..., 2:6], x.unfold(-1, 5, 1).mean(-1)[..., :4] * 1.0)


def test_quality_merge_joins_rows_of_one_seed(tmp_path):
    quality = pytest.importorskip("quality")
    a = {"seed": 0, "rows": {"map": {"v": torch.tensor([1.0])}, "x": {"v": torch.tensor([2.0])}}}
    b = {"seed": 0, "rows": {"map": {"v": torch.tensor([9.0])}, "y": {"v": torch.tensor([3.0])}}}
    c = {"seed": 1, "rows": {"map": {"v": torch.tensor([4.0])}}}
    paths = []
    for i, run in enumerate((a, b, c)):
        quality._save_seed(run, tmp_path / f"s{i}.pt")
        paths.append(str(tmp_path / f"s{i}.pt"))
    merged = quality._merge(paths)
    assert sorted(merged) == [0, 1]
    assert sorted(merged[0]["rows"]) == ["map", "x", "y"]
    assert merged[0]["rows"]["map"]["v"].item() == 1.0  # the first file's row is kept
