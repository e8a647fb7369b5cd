"""MixturePredictor: the equal-weight mixture of calibrated predictors (MultiSWAG).

The mixture's predictive is the mean of the parts' tempered predictives (brute force), its
epistemic part the parts' disagreement, a mixture of identical parts is that part, it
exports equal to in-process (SWAG members, a Laplace link, a plain network), and bad parts
are refused before anything runs.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bayesify as bz
from bayesify import BayesifyError, MixturePredictor, ModelPredictor, bayesify, fit
from bayesify.data.digits import digits_loaders
from bayesify.data.models import DigitsCNN, train_map
from bayesify.predict.export import run_exported


@pytest.fixture(scope="module")
def nets(digits):
    """Two width-8 digits CNNs trained apart (seeds 0, 1), and a short training loader."""
    loaders = digits_loaders(digits, batch_size=64, seed=0)
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        out.append(train_map(DigitsCNN(digits.num_classes, width=8), loaders["train"],
                             epochs=2, seed=seed))
    x, y = digits.train.tensors[0][:256], digits.train.tensors[1][:256]
    return out, DataLoader(TensorDataset(x, y), batch_size=32)


@pytest.fixture(scope="module")
def swags(nets):
    """SWAG-diagonal around each network (fixed scale, no search: fast)."""
    networks, loader = nets
    parts = []
    for net in networks:
        bnn = bayesify(copy.deepcopy(net), "swag", variant="diag", predict_samples=3,
                       bn_update_fraction=0.25)
        fit(bnn, loader, epochs=2, progress=False)
        parts.append(bnn.predictor(temperature=0.8))
    return parts


def test_the_mixture_is_the_mean_of_the_tempered_parts(nets, digits):
    networks, _ = nets
    a = ModelPredictor(networks[0], temperature=0.7)
    b = ModelPredictor(networks[1], temperature=1.6)
    x = digits.test.tensors[0][:17]
    mixture = MixturePredictor([a, b], temperature=1.3)
    expected = 0.5 * (a(x).probs + b(x).probs)
    expected = torch.softmax(expected.log() / 1.3, -1)
    torch.testing.assert_close(mixture(x).probs, expected, atol=1e-6, rtol=0)
    # the epistemic part is the parts' disagreement: the mutual information between them
    raw = MixturePredictor([a, b])(x)
    p = torch.stack([a(x).probs, b(x).probs])
    mean = p.mean(0)
    mi = -(mean * mean.log()).sum(-1) + (p * p.log()).sum(-1).mean(0)
    torch.testing.assert_close(raw.epistemic, mi, atol=1e-5, rtol=0)
    assert float(raw.epistemic.mean()) > 1e-4  # two networks trained apart do disagree


def test_identical_parts_give_the_part(nets, digits):
    networks, _ = nets
    a = ModelPredictor(networks[0], temperature=0.9)
    x = digits.test.tensors[0][:9]
    out = MixturePredictor([a, ModelPredictor(networks[0], temperature=0.9)])(x)
    torch.testing.assert_close(out.probs, a(x).probs, atol=1e-6, rtol=0)
    assert float(out.epistemic.abs().max()) < 1e-6


def test_multiswag_exports_equal_to_in_process(swags, digits, tmp_path):
    mixture = MixturePredictor(swags, temperature=1.2)
    x = digits.test.tensors[0][:11]
    info = mixture.export(tmp_path / "m.pt2", digits.val.tensors[0][:3])
    assert info["members"] == 2 and info["max_abs_diff"] <= 1e-5
    assert info["metadata"]["method"] == "mixture(swag, swag)"
    probs, epistemic = run_exported(tmp_path / "m.pt2", x)
    reference = mixture(x)
    torch.testing.assert_close(probs, reference.probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(epistemic, reference.epistemic, atol=1e-5, rtol=0)
    # another part's posterior is another fingerprint
    other = MixturePredictor([swags[1], swags[0]], temperature=1.2)
    assert (other.export(tmp_path / "o.pt2", digits.val.tensors[0][:3])["metadata"]
            ["posterior_fingerprint"] != info["metadata"]["posterior_fingerprint"])


def test_a_laplace_part_exports_through_its_link(nets, digits, tmp_path):
    networks, loader = nets
    bnn = bayesify(copy.deepcopy(networks[0]), "laplace", prior_method="fixed",
                   prior_precision=0.5)
    fit(bnn, loader, progress=False)
    mixture = MixturePredictor([bnn.predictor(temperature=0.6), ModelPredictor(networks[1])])
    x = digits.test.tensors[0][:7]
    info = mixture.export(tmp_path / "l.pt2", digits.val.tensors[0][:3])
    assert info["max_abs_diff"] <= 1e-5
    probs, _ = run_exported(tmp_path / "l.pt2", x)
    torch.testing.assert_close(probs, mixture(x).probs, atol=1e-5, rtol=0)


def test_evaluate_and_calibrate_work_on_a_mixture(swags, digits):
    loaders = digits_loaders(digits, batch_size=64, seed=0)
    mixture = MixturePredictor(swags)
    out = mixture.evaluate(loaders["test"], loaders["ood"], progress=False)
    assert 0.5 < out["accuracy"] <= 1.0 and math.isfinite(out["nll"])
    assert 0.0 <= out["ood_auroc_entropy"] <= 1.0
    before = mixture.evaluate(loaders["val"], progress=False)["nll"]
    mixture.calibrate(loaders["val"])
    assert mixture.evaluate(loaders["val"], progress=False)["nll"] <= before + 1e-6


@pytest.mark.parametrize(("parts", "message"), [
    ("not a list", "list of predictors"),
    ([], "two or more"),
    ([1, 2], "must be predictors"),
])
def test_bad_parts_are_refused(parts, message):
    with pytest.raises(BayesifyError, match=message):
        MixturePredictor(parts)


def test_one_predictor_is_refused_with_the_fix(nets):
    networks, _ = nets
    with pytest.raises(BayesifyError, match="use the predictor itself"):
        MixturePredictor([ModelPredictor(networks[0])])
    with pytest.raises(BayesifyError, match="list of predictors"):
        MixturePredictor(ModelPredictor(networks[0]))


def test_parts_of_other_classes_are_refused(nets, digits):
    networks, _ = nets
    other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    mixture = MixturePredictor([ModelPredictor(networks[0]), ModelPredictor(other)])
    with pytest.raises(BayesifyError, match="same classes"):
        mixture(digits.test.tensors[0][:4])


def test_the_package_carries_it():
    assert bz.MixturePredictor is MixturePredictor


class _TokenNet(torch.nn.Module):
    """A toy text classifier called as ``model(input_ids=..., attention_mask=...)``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.emb(input_ids) * mask).sum(1) / mask.sum(1).clamp_min(1)
        return self.head(pooled)


def test_dict_batches_predict_and_export(tmp_path):
    parts = [ModelPredictor(_TokenNet(s), temperature=t) for s, t in ((0, 0.8), (1, 1.5))]
    mixture = MixturePredictor(parts)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 50, (5, 7), generator=g),
             "attention_mask": torch.ones(5, 7, dtype=torch.long)}
    expected = 0.5 * (parts[0](batch).probs + parts[1](batch).probs)
    torch.testing.assert_close(mixture(batch).probs, expected, atol=1e-6, rtol=0)
    info = mixture.export(tmp_path / "t.pt2", batch)
    assert info["max_abs_diff"] <= 1e-5 and info["metadata"]["method"].startswith("mixture(")
