"""Checks every registered posterior family must pass (parametrised over ``list_methods()``).

A new family cannot skip these: wrap (a small CNN and the digits CNN), identity in
``deterministic()`` mode where the family claims one, one training step reduces the
loss on a fixed batch (post-hoc families: their ``fit`` on a tiny loader), predict
shapes ``[M, B, C]`` with probabilities summing to 1, ``unwrap()`` restores the
original ``state_dict`` exactly, and a bad config raises ``BayesifyError``.

Each family runs with its defaults; ``IDENTITY_OPTIONS`` only names the init options
that make the identity exact, ``FAST_OPTIONS`` keeps expensive defaults small.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesianLayer, BayesifyError, bayesify, list_methods
from bayesify.data.models import DigitsCNN
from bayesify.train.steps import build_optimizer

#: options under which ``deterministic()`` is exactly the base network
IDENTITY_OPTIONS: dict[str, dict] = {
    "ibnn": {"init_mean_std": 0.0},
    "rank1": {"init": "ones"},
    "batchensemble": {"init": "ones"},
    "ensemble": {"head_init": "pretrained", "init_noise": 0.0},
}
#: smaller-than-default options for speed only (never needed for correctness)
FAST_OPTIONS: dict[str, dict] = {}

METHODS = list_methods()
NUM_CLASSES = 5


class SmallCNN(nn.Module):
    """Conv-BN-ReLU, Conv-ReLU, pool, Linear on ``[B, 1, 8, 8]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.conv2(h))
        return self.fc(self.pool(h).flatten(1))


def _with_stats(model: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm statistics, eval mode (a 'pretrained' network)."""
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
    return model.eval()


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"small_cnn": _with_stats(SmallCNN()), "digits_cnn": _with_stats(DigitsCNN(NUM_CLASSES, width=8))}


def _options(method: str, *, identity: bool = False) -> dict:
    opts = dict(FAST_OPTIONS.get(method, {}))
    if identity:
        opts.update(IDENTITY_OPTIONS.get(method, {}))
    return opts


def _batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.rand(n, 1, 8, 8, generator=gen), torch.randint(0, NUM_CLASSES, (n,), generator=gen)


@pytest.mark.parametrize("model_name", ["small_cnn", "digits_cnn"])
@pytest.mark.parametrize("method", METHODS)
def test_wrap_forward_and_unwrap(method: str, model_name: str) -> None:
    model = _models()[model_name]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bnn = bayesify(model, method, **_options(method))
    assert bnn.bayesian_layers(), "no layer was wrapped"
    assert bnn.method_name == method
    x, _ = _batch()
    out = bnn(x)
    assert out.shape == (x.shape[0], NUM_CLASSES)
    assert torch.isfinite(out).all()
    # the caller's model is untouched and unwrap() gives back its exact state
    restored = bnn.unwrap().state_dict()
    assert list(restored) == list(before)
    for key, value in before.items():
        assert torch.equal(restored[key], value), key
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("model_name", ["small_cnn", "digits_cnn"])
@pytest.mark.parametrize("method", METHODS)
def test_deterministic_identity(method: str, model_name: str) -> None:
    model = _models()[model_name]
    x, _ = _batch()
    with torch.no_grad():
        expected = model(x)
        bnn = bayesify(model, method, **_options(method, identity=True)).eval()
        with bnn.deterministic():
            got = bnn(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_one_step_reduces_loss(method: str) -> None:
    """Common random numbers: the step descends on exactly the loss it measured."""
    model = _models()["digits_cnn"]
    bnn = bayesify(model, method, **_options(method))
    x, y = _batch(8)
    n_train = 1000
    if not bnn.method.step().optimizes:
        from bayesify import fit

        loader = DataLoader(TensorDataset(*_batch(16)), batch_size=8)
        fit(bnn, loader, epochs=1, progress=False)
        pred = bnn.predictor()(x)
        assert torch.isfinite(pred.probs).all()
        return

    def loss_at() -> torch.Tensor:
        torch.manual_seed(123)
        bnn.train()
        logits, targets = bnn.training_forward(x, y)
        return F.cross_entropy(logits.float(), targets) + bnn.kl().float() / n_train

    lr = 0.1 * bnn.method.step().defaults["lr"]
    opt = build_optimizer(bnn, lr=lr, base_lr=0.0, optimizer="sgd", momentum=0.0,
                          weight_decay=0.0, base_weight_decay=0.0)
    before = loss_at()
    opt.zero_grad()
    before.backward()
    grads = [p.grad for g in opt.param_groups for p in g["params"]]
    assert any(g is not None and g.abs().sum() > 0 for g in grads), "no gradient reached the posterior"
    opt.step()
    with torch.no_grad():
        after = loss_at()
    assert after.item() < before.item()


@pytest.mark.parametrize("method", METHODS)
def test_predict_shapes_and_normalisation(method: str) -> None:
    model = _models()["small_cnn"]
    bnn = bayesify(model, method, **_options(method))
    if not bnn.method.step().ready(bnn):  # a posterior only fit builds: the predictor refuses
        from bayesify import fit

        fit(bnn, DataLoader(TensorDataset(*_batch(16)), batch_size=8), epochs=1, progress=False)
    x, _ = _batch(5)
    pred = bnn.predictor()(x)
    logits = pred.member_logits
    assert logits.dim() == 3 and logits.shape[1:] == (5, NUM_CLASSES) and logits.shape[0] >= 1
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(5), rtol=0, atol=1e-5)
    torch.testing.assert_close(pred.member_probs.sum(-1), torch.ones(logits.shape[:2]), rtol=0, atol=1e-5)
    assert (pred.epistemic >= 0).all()
    # fixed members: the same call gives the same networks
    torch.testing.assert_close(bnn.predictor()(x).member_logits, logits)


@pytest.mark.parametrize("method", METHODS)
def test_bad_config_raises(method: str) -> None:
    model = _models()["small_cnn"]
    with pytest.raises(BayesifyError):
        bayesify(model, method, components=0)
    with pytest.raises(BayesifyError):
        bayesify(model, method, no_such_option_xyz=1)
    with pytest.raises(BayesifyError):
        bayesify(model, method, targets=["pool"])  # an unsupported module named explicitly
    # a failed call never modifies the caller's model
    assert not any(isinstance(m, BayesianLayer) for m in model.modules())
    assert copy.deepcopy(model)(torch.zeros(1, 1, 8, 8)).shape == (1, NUM_CLASSES)
