"""bayesify.evaluation: corruption math, FGSM, OOD scoring and the report table/figures."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayesify
from bayesify import metrics
from bayesify.errors import BayesifyError
from bayesify.evaluation import (
    TABLE_KEYS,
    bootstrap_se,
    corrupt,
    differentiable_member_logits,
    fgsm,
    fgsm_sweep,
    gaussian_mix,
    input_gradient,
    ood_scores,
    report,
    rotate,
    salt_and_pepper,
    summarize,
)
from bayesify.predict.predictor import BasePredictor, ModelPredictor

# -- corruptions ---------------------------------------------------------------------------


def test_gaussian_mix_is_the_convex_combination_with_one_noise_draw():
    x = torch.rand(6, 1, 8, 8)
    assert torch.equal(gaussian_mix(x, 0.0, seed=3), x)
    eps = gaussian_mix(x, 1.0, seed=3)  # γ = 1 is the noise itself
    assert abs(eps.mean().item()) < 0.2 and abs(eps.std().item() - 1.0) < 0.15
    for gamma in (0.1, 0.5, 0.9):
        expected = (1 - gamma) * x + gamma * eps
        torch.testing.assert_close(gaussian_mix(x, gamma, seed=3), expected)
    assert not torch.equal(gaussian_mix(x, 0.5, seed=3), gaussian_mix(x, 0.5, seed=4))
    with pytest.raises(ValueError):
        gaussian_mix(x, 1.5)


def test_salt_and_pepper_replaces_a_fraction_p_by_the_extremes():
    x = torch.full((20, 3, 16, 16), 0.5)
    assert torch.equal(salt_and_pepper(x, 0.0), x)
    out = salt_and_pepper(x, 0.3, seed=1)
    changed = out != 0.5
    n = x.numel()
    # binomial(n, 0.3): 5 standard deviations
    assert abs(changed.float().mean().item() - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n)
    assert set(out[changed].unique().tolist()) == {0.0, 1.0}
    salt = (out == 1.0).float().sum() / changed.float().sum()
    assert abs(salt.item() - 0.5) < 0.05
    full = salt_and_pepper(x, 1.0, seed=1, low=-1.0, high=2.0)
    assert set(full.unique().tolist()) == {-1.0, 2.0}
    assert torch.equal(x, torch.full_like(x, 0.5)), "the input must not be modified"


def test_rotation_identities():
    x = torch.rand(3, 2, 8, 8)
    assert torch.equal(rotate(x, 0.0), x)
    assert torch.equal(rotate(x, 360.0), x)
    # a square grid maps pixel centres onto pixel centres at 90°: exact rot90 (CCW)
    torch.testing.assert_close(rotate(x, 90.0), torch.rot90(x, 1, dims=(2, 3)))
    torch.testing.assert_close(rotate(x, 180.0), torch.rot90(x, 2, dims=(2, 3)))
    # bilinear resampling is exact on a linear ramp: ±45° restores the interior
    grid = torch.arange(16.0)
    ramp = (0.3 * grid[:, None] + 0.7 * grid[None, :]).expand(1, 1, 16, 16)
    torch.testing.assert_close(rotate(rotate(ramp, 45.0), -45.0)[..., 5:11, 5:11],
                               ramp[..., 5:11, 5:11], atol=1e-4, rtol=0)
    assert not torch.allclose(rotate(ramp, 45.0)[..., 5:11, 5:11], ramp[..., 5:11, 5:11])
    # a constant image stays constant inside, the corners take the fill value
    ones = rotate(torch.ones(1, 1, 9, 9), 45.0, fill=0.0)
    assert ones[0, 0, 4, 4].item() == pytest.approx(1.0)
    assert ones[0, 0, 0, 0].item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(BayesifyError):
        rotate(torch.rand(4, 8), 30.0)
    with pytest.raises(BayesifyError, match="unknown corruption"):
        corrupt(x, "blur", 1.0)


# -- OOD scoring -----------------------------------------------------------------------------


def _stats(entropy: torch.Tensor, epistemic: torch.Tensor, classes: int = 5) -> dict:
    return {"entropy": entropy, "epistemic": epistemic, "aleatoric": entropy - epistemic,
            "probs": torch.full((entropy.numel(), classes), 1.0 / classes)}


def test_ood_auroc_of_separated_scores_and_entropy_cdf():
    in_stats = _stats(torch.linspace(0.0, 0.5, 50), torch.linspace(0.0, 0.1, 50))
    ood = _stats(torch.linspace(0.6, 1.2, 40), torch.linspace(0.2, 0.3, 40))
    scores = ood_scores(in_stats, ood)
    assert scores["ood_auroc_entropy"] == 1.0 and scores["ood_auroc_mi"] == 1.0
    assert ood_scores(ood, in_stats)["ood_auroc_entropy"] == 0.0
    expected = 1.0 - (ood["entropy"] / math.log(5)).clamp(0, 1).mean().item()
    assert scores["ood_entropy_cdf_auc"] == pytest.approx(expected)
    # identical distributions: AUROC 1/2 (ties count one half)
    same = _stats(torch.ones(10), torch.linspace(0.0, 1.0, 10))
    assert ood_scores(same, same)["ood_auroc_mi"] == pytest.approx(0.5)
    # a score that is 0 everywhere (a single network's MI) has no signal: n/a, not 0.5
    assert ood_scores(_stats(torch.ones(10), torch.zeros(10)),
                      _stats(torch.ones(10), torch.zeros(10)))["ood_auroc_mi"] is None


def test_bootstrap_se_matches_the_standard_error_of_a_mean():
    values = torch.randn(400, generator=torch.Generator().manual_seed(0))
    se = bootstrap_se(lambda v: v.mean(), values, num=400, seed=1)
    assert se == pytest.approx(values.std().item() / math.sqrt(400), rel=0.2)
    assert bootstrap_se(lambda v: v.mean(), torch.ones(30), num=20) == 0.0


# -- FGSM --------------------------------------------------------------------------------------


class _LinearPair(BasePredictor):
    """Two linear softmax models, differentiable by construction."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
        self.temperature = 1.5

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def member_logits(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,mic->mbc", x, self.w)

    def differentiable_member_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.member_logits(x)


def test_input_gradient_is_the_gradient_of_the_mixture_nll():
    predictor = _LinearPair()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 0])

    def loss(inp: torch.Tensor) -> float:
        log_p = metrics.mixture_log_probs(predictor.member_logits(inp).double())
        tempered = (log_p / predictor.temperature).log_softmax(-1)  # on the predictive
        return metrics.per_example_nll(tempered, y).sum().item()

    grad = input_gradient(predictor, x, y)
    h = 1e-2  # the mixture is evaluated in float32: a central difference with a wide step
    for b, i in [(0, 0), (2, 3), (4, 1)]:
        step = torch.zeros_like(x)
        step[b, i] = h
        numeric = (loss(x + step) - loss(x - step)) / (2 * h)
        assert grad[b, i].item() == pytest.approx(numeric, rel=2e-3, abs=1e-4)


def test_differentiable_path_reproduces_the_predictor_members(digits, digits_map):
    x = digits.test.tensors[0][:16]
    plain = ModelPredictor([digits_map, digits_map], temperature=2.0)
    # the members untempered: the temperature acts on the predictive (input_gradient)
    torch.testing.assert_close(differentiable_member_logits(plain, x).detach(),
                               plain.member_logits(x))
    bnn = bayesify.bayesify(digits_map, "ibnn", components=2, init_mean_std=0.3)
    predictor = bnn.predictor(samples_per_component=2, seed=7)
    logits = differentiable_member_logits(predictor, x)
    assert logits.requires_grad and logits.shape == (4, 16, digits.num_classes)
    torch.testing.assert_close(logits.detach(), predictor.member_logits(x), atol=1e-5, rtol=1e-5)


def test_fgsm_raises_the_loss_and_lowers_accuracy_on_a_trained_net(digits, digits_map):
    x, y = digits.test.tensors[0], digits.test.tensors[1]
    for predictor in (ModelPredictor(digits_map),
                      bayesify.bayesify(digits_map, "ibnn", components=2,
                                        init_mean_std=0.2).predictor(samples_per_component=2)):
        clean = predictor(x)
        adv_x = fgsm(predictor, x, y, 0.2)
        assert adv_x.min() >= 0.0 and adv_x.max() <= 1.0
        assert (adv_x - x).abs().max() <= 0.2 + 1e-6
        adv = predictor(adv_x)
        nll_clean = metrics.per_example_nll(clean.log_probs, y).mean()
        nll_adv = metrics.per_example_nll(adv.log_probs, y).mean()
        assert nll_adv > nll_clean + 0.5
        assert (adv.argmax() == y).float().mean() < (clean.argmax() == y).float().mean() - 0.1
    rows = fgsm_sweep(ModelPredictor(digits_map), DataLoader(digits.test, batch_size=128),
                      [0.0, 0.1, 0.3])
    assert [r["epsilon"] for r in rows] == [0.0, 0.1, 0.3]
    accs = [r["accuracy"] for r in rows]
    assert accs[0] == pytest.approx(summarize({**_plain_stats(digits_map, x, y)})["accuracy"])
    assert accs[0] > accs[1] > accs[2]
    with pytest.raises(BayesifyError, match="epsilon"):
        fgsm(ModelPredictor(digits_map), x, y, -0.1)


def _plain_stats(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    pred = ModelPredictor(model)(x)
    return {"probs": pred.probs, "labels": y, "entropy": pred.entropy, "aleatoric": pred.aleatoric,
            "epistemic": pred.epistemic, "nll": metrics.per_example_nll(pred.log_probs, y)}


class _NoGrad(BasePredictor):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @torch.no_grad()
    def member_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).unsqueeze(0)


# -- report ----------------------------------------------------------------------------------


def test_report_table_and_figures(tmp_path, digits, digits_map):
    test = TensorDataset(digits.test.tensors[0][:96], digits.test.tensors[1][:96])
    loaders = {"test": DataLoader(test, batch_size=64),
               "ood": DataLoader(TensorDataset(digits.ood.tensors[0][:96]), batch_size=64)}
    bnn = bayesify.bayesify(digits_map, "ibnn", components=2, init_mean_std=0.2)
    predictors = {"map": ModelPredictor(digits_map), "ibnn": bnn.predictor(samples_per_component=2),
                  "nograd": _NoGrad(digits_map)}
    sweeps = {"gaussian": (0.1, 0.9), "salt_pepper": (0.1,), "rotation": (45.0,)}
    table = report(predictors, loaders, out_dir=tmp_path, sweeps=sweeps, fgsm_epsilons=(0.0, 0.1))
    assert all(tuple(row) == TABLE_KEYS for row in table)
    evaluations = {(r["method"], r["evaluation"]) for r in table}
    for method in predictors:
        for ev in ("clean", "ood", "gaussian", "salt_pepper", "rotation", "fgsm"):
            assert (method, ev) in evaluations
    for row in table:
        if row["entropy"] is not None:
            assert row["entropy"] == pytest.approx(row["aleatoric"] + row["epistemic"], abs=1e-5)
    clean = {r["method"]: r for r in table if r["evaluation"] == "clean"}
    fgsm0 = {r["method"]: r for r in table if r["evaluation"] == "fgsm" and r["level"] == 0.0}
    assert clean["map"]["accuracy"] == pytest.approx(fgsm0["map"]["accuracy"])
    assert clean["map"]["epistemic"] == pytest.approx(0.0, abs=1e-6)  # one member: no MI
    gauss = [r for r in table if r["method"] == "map" and r["evaluation"] == "gaussian"]
    assert gauss[1]["accuracy"] < gauss[0]["accuracy"] <= clean["map"]["accuracy"] + 0.05
    ood = next(r for r in table if r["evaluation"] == "ood" and r["method"] == "map")
    assert 0.5 < ood["ood_auroc_entropy"] <= 1.0
    skipped = [r for r in table if r["method"] == "nograd" and r["evaluation"] == "fgsm"]
    assert len(skipped) == 1 and "differentiable" in skipped[0]["note"]
    for name in ("reliability.png", "uncertainty_hist.png", "uncertainty_gaussian.png",
                 "uncertainty_salt_pepper.png", "uncertainty_rotation.png", "fgsm.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert (tmp_path / "report.json").exists()
    with pytest.raises(BayesifyError, match="test"):
        report(predictors, {"ood": loaders["ood"]})


# -- peer adapters ---------------------------------------------------------------------------


def test_bayesian_torch_kl_sum_is_the_elbo_kl_and_get_kl_loss_averages():
    pytest.importorskip("bayesian_torch")
    from bayesify.evaluation import peers

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 4, bias=False), nn.ReLU(), nn.Linear(4, 3, bias=False))
    bnn = peers.to_bayesian_torch(net, moped_delta=0.1, prior_sigma=0.5)
    layers = [m for m in bnn.modules() if hasattr(m, "kl_loss")]
    expected = 0.0
    per_tensor_means = 0.0
    for layer, base in zip(layers, (net[0], net[2])):
        sigma = 0.1 * base.weight.abs()  # MOPED: σ = δ·|w| (up to get_rho's 1e-20 floor)
        kl = (math.log(0.5) - sigma.log() + (sigma**2 + base.weight**2) / (2 * 0.25) - 0.5)
        expected += kl.sum().item()
        per_tensor_means += kl.mean().item()
    assert peers.bayesian_torch_kl_sum(bnn).item() == pytest.approx(expected, rel=1e-4)
    assert peers.bayesian_torch_kl_mean(bnn).item() == pytest.approx(per_tensor_means, rel=1e-4)
    note = peers.kl_scaling_note(bnn)
    assert note["weights"] == 6 * 4 + 4 * 3 and note["ratio"] > 1
    # M fixed members: the same seed reproduces them, another seed draws others
    x = torch.randn(5, 6)
    pred = peers.SampledModelPredictor(bnn, 3, seed=1)
    first = pred.member_logits(x)
    assert torch.equal(first, pred.member_logits(x))
    assert not torch.allclose(first[0], first[1])
    assert not torch.equal(first, peers.SampledModelPredictor(bnn, 3, seed=2).member_logits(x))
    assert differentiable_member_logits(pred, x).requires_grad


def test_laplace_torch_on_mapping_batches_equals_it_on_tensors():
    """A model fed Hugging Face mappings (the text protocol) gets laplace-torch's own
    convention (``model(batch)``) through ``peers.MappingModel``: the same posterior and
    predictive as the same network fed tensors."""
    pytest.importorskip("laplace")
    from torch.utils.data import DataLoader, TensorDataset

    from bayesify.core.batch import Batch
    from bayesify.evaluation import peers

    class Keywords(nn.Module):
        def __init__(self, body: nn.Module) -> None:
            super().__init__()
            self.body = body

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.body(features)

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    tensors = DataLoader(TensorDataset(x, y), batch_size=8)
    mappings = DataLoader([{"features": xi, "labels": yi} for xi, yi in zip(x, y)], batch_size=8)
    plain = peers.LaplaceTorchPredictor(peers.fit_laplace_torch(body, tensors))
    keyed = peers.LaplaceTorchPredictor(peers.fit_laplace_torch(Keywords(body), mappings))
    assert isinstance(keyed.la.model.model, peers.MappingModel)
    test = torch.randn(6, 5)
    want = plain.member_logits(test)
    got = keyed.member_logits(Batch((), {"features": test}, None))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want.softmax(-1), body(test).softmax(-1), atol=1e-3)


def test_insert_dropout_wraps_every_layer_but_the_stem():
    from bayesify.data.models import DigitsCNN
    from bayesify.evaluation import peers

    model = peers.insert_dropout(DigitsCNN(5), 0.2)
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert len(drops) == 3 and all(d.p == 0.2 for d in drops)  # conv2, conv3, fc
    assert isinstance(model.features[0], nn.Conv2d)
    with pytest.raises(BayesifyError):
        peers.insert_dropout(model, 1.5)
