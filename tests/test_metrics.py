"""Metrics against scikit-learn and brute-force references."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from bayesify import metrics, plots
from bayesify.predict import Prediction


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 200, 4, generator=g) * 2
    labels = torch.randint(0, 4, (200,), generator=g)
    return logits, labels


def test_nll_matches_sklearn_log_loss(batch):
    logits, labels = batch
    probs = logits.softmax(-1).mean(0)
    ref = log_loss(labels.numpy(), probs.double().numpy(), labels=[0, 1, 2, 3])
    assert math.isclose(metrics.nll(probs, labels), ref, rel_tol=1e-5)
    assert math.isclose(metrics.nll_from_member_logits(logits, labels), ref, rel_tol=1e-5)


def test_brier_brute_force(batch):
    logits, labels = batch
    probs = logits[0].softmax(-1)
    ref = np.mean([sum((probs[i, c].item() - (labels[i].item() == c)) ** 2 for c in range(4))
                   for i in range(200)])
    assert math.isclose(metrics.brier(probs, labels), ref, rel_tol=1e-6)


def test_ece_brute_force(batch):
    logits, labels = batch
    probs = logits[0].softmax(-1)
    conf, pred = probs.max(-1)
    total = 0.0
    for b in range(15):
        lo, hi = b / 15, (b + 1) / 15
        members = [i for i in range(200) if lo < conf[i].item() <= hi]
        if members:
            acc = np.mean([pred[i].item() == labels[i].item() for i in members])
            avg = np.mean([conf[i].item() for i in members])
            total += abs(acc - avg) * len(members) / 200
    assert math.isclose(metrics.ece(probs, labels), total, rel_tol=1e-6, abs_tol=1e-9)


def test_ece_of_perfectly_calibrated_and_overconfident():
    conf = torch.full((1000,), 0.8)
    correct = torch.zeros(1000)
    correct[:800] = 1
    assert metrics.ece_from_confidence(conf, correct) < 1e-6
    assert math.isclose(metrics.ece_from_confidence(conf, torch.ones(1000)), 0.2, rel_tol=1e-6)


def test_auroc_matches_sklearn_with_ties():
    g = torch.Generator().manual_seed(1)
    neg = torch.randint(0, 10, (300,), generator=g).float()
    pos = torch.randint(3, 13, (200,), generator=g).float()
    ref = roc_auc_score(np.r_[np.zeros(300), np.ones(200)], torch.cat([neg, pos]).numpy())
    assert math.isclose(metrics.auroc(neg, pos), ref, rel_tol=1e-9)
    assert metrics.auroc(torch.zeros(5), torch.ones(5)) == 1.0
    assert metrics.auroc(torch.ones(5), torch.zeros(5)) == 0.0


def test_uncertainty_decomposition():
    agree = torch.tensor([[0.7, 0.2, 0.1]]).expand(4, 1, 3)
    assert metrics.mutual_information(agree).item() < 1e-6
    confident_disagreement = torch.eye(3).unsqueeze(1)  # [3 members, 1, 3 classes]
    assert math.isclose(metrics.mutual_information(confident_disagreement).item(), math.log(3),
                        rel_tol=1e-5)
    assert math.isclose(metrics.variation_ratio(confident_disagreement).item(), 2 / 3, rel_tol=1e-6)


def test_prediction_fields_are_consistent(batch):
    logits, _ = batch
    pred = Prediction(logits)
    assert torch.allclose(pred.probs, logits.softmax(-1).mean(0), atol=1e-6)
    assert torch.allclose(pred.entropy, pred.aleatoric + pred.epistemic, atol=1e-5)
    assert (pred.epistemic >= 0).all()
    assert pred.predictive_variance.shape == (200, 4)
    assert torch.allclose(pred.probs.sum(-1), torch.ones(200), atol=1e-5)


def test_entropy_cdf_auc():
    uniform = torch.full((10,), math.log(5))
    assert metrics.entropy_cdf_auc(uniform, 5) == pytest.approx(0.0, abs=1e-9)
    assert metrics.entropy_cdf_auc(torch.zeros(10), 5) == pytest.approx(1.0)


def test_reliability_and_histogram_pngs(tmp_path, batch):
    logits, labels = batch
    probs = logits[0].softmax(-1)
    conf, pred = probs.max(-1)
    p1 = plots.save_reliability_diagram({"a": (conf, (pred == labels).float())},
                                          tmp_path / "rel.png")
    p2 = plots.save_uncertainty_histograms({"a": {"in": metrics.entropy(probs)}},
                                        tmp_path / "hist.png", 4)
    assert p1.read_bytes()[:4] == b"\x89PNG" and p2.stat().st_size > 1000
