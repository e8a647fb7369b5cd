"""Mathematics of the batch-tiled families: rank1, batchensemble, dropout, ensemble, member BN."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit
from bayesify.kit.member_bn import MemberBatchNorm
from bayesify.kit.rank_one import gaussian_kl
from bayesify.kit.steps import SnapshotStep
from bayesify.methods.ensemble.layers import EnsembleLayer
from bayesify.train.steps import build_optimizer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _net() -> Net:
    torch.manual_seed(0)
    net = Net().eval()
    net.bn.running_mean.uniform_(-0.5, 0.5)
    net.bn.running_var.uniform_(0.5, 1.5)
    return net


X = torch.randn(5, 2, 6, 6, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 1, 2, 0, 1])


@pytest.mark.parametrize("method", ["rank1", "batchensemble"])
def test_rank1_member_equals_explicit_weight(method: str) -> None:
    """Member k computes x W_k + b_k with W_k = W ∘ (s_k r_kᵀ) (brute force)."""
    net = _net()
    bnn = bayesify(net, method, init="normal", components=3)
    with torch.no_grad():
        for layer in bnn.bayesian_layers().values():
            layer.member_bias.normal_()
    conv, fc = bnn.model.conv, bnn.model.fc
    x2 = torch.randn(5, 4)
    for k in range(3):
        comp = torch.full((5,), k)
        with torch.no_grad(), bnn.context.use(comp, deterministic=True):
            got_conv, got_fc = conv(X), fc(x2)
        w_conv = net.conv.weight * (conv.s[k][:, None] * conv.r[k][None, :])[:, :, None, None]
        want_conv = F.conv2d(X, w_conv, conv.member_bias[k], padding=1)
        want_fc = F.linear(x2, net.fc.weight * (fc.s[k][:, None] * fc.r[k][None, :]), fc.member_bias[k])
        torch.testing.assert_close(got_conv, want_conv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_fc, want_fc, rtol=1e-5, atol=1e-5)


def test_rank1_kl_closed_form_and_sampling() -> None:
    bnn = bayesify(_net(), "rank1", components=2, init_std=0.05, prior_std=0.1)
    total = 0.0
    for layer in bnn.bayesian_layers().values():
        for mean, rho in ((layer.r, layer.r_rho), (layer.s, layer.s_rho)):
            # per_network (default): the prior std 0.1 is the network's, 0.1/√(2L) per factor
            total += gaussian_kl(mean, F.softplus(rho) ** 2, 1.0, layer.prior_std).sum()
            assert layer.prior_std == pytest.approx(0.1 / math.sqrt(2 * len(
                bnn.bayesian_layers())))
    # mean over the K = 2 members: the NLL is the mean over the K-tiled batch (issue 13)
    torch.testing.assert_close(bnn.kl(), total / 2)
    # KL averaged over members: identical members give the KL of one, whatever K
    ones = bayesify(_net(), "rank1", components=1, init="ones").kl()
    torch.testing.assert_close(bayesify(_net(), "rank1", components=4, init="ones").kl(), ones)
    # sampled factors have the posterior std around the means
    layer = bnn.model.fc
    with bnn.context.use(torch.zeros(20000, dtype=torch.long)):
        r, _s, _ = layer.factors(20000, torch.device("cpu"))
    torch.testing.assert_close(r.std(0), F.softplus(layer.r_rho[0]), rtol=0.05, atol=0)
    torch.testing.assert_close(r.mean(0), layer.r[0], rtol=0, atol=3e-3)
    assert bayesify(_net(), "batchensemble").kl().item() == 0.0


@pytest.mark.parametrize("method", ["rank1", "batchensemble"])
def test_rank_one_spread_is_per_network(method: str) -> None:
    """per_network: the factors' offsets from 1 (and rank1's stds and prior) are the whole
    network's, ÷√(2L); per layer (False) they are the configured values."""
    torch.manual_seed(0)
    per_layer = bayesify(_net(), method, components=64, per_network=False)
    torch.manual_seed(0)
    network = bayesify(_net(), method, components=64)
    layers = len(network.bayesian_layers())
    assert layers > 1
    shrink = 1 / math.sqrt(2 * layers)
    for a, b in zip(per_layer.bayesian_layers().values(), network.bayesian_layers().values(),
                    strict=True):
        torch.testing.assert_close(b.r - 1, (a.r - 1) * shrink)
        torch.testing.assert_close(b.s - 1, (a.s - 1) * shrink)
        if method == "rank1":
            torch.testing.assert_close(F.softplus(b.r_rho), F.softplus(a.r_rho) * shrink)
            assert b.prior_std == pytest.approx(a.prior_std * shrink)


@pytest.mark.parametrize("method", ["rank1", "batchensemble", "ensemble"])
def test_tiled_training_layout(method: str) -> None:
    bnn = bayesify(_net(), method, components=3)
    comp = bnn.method.step().layout.components(5, torch.device("cpu"))
    assert comp.tolist() == [k for k in range(3) for _ in range(5)]  # component = row // B
    logits, targets = bnn.training_forward(X, Y)
    assert logits.shape == (15, 3) and targets.tolist() == Y.tolist() * 3


def test_rank1_members_fixed_and_chunking_invariant() -> None:
    bnn = bayesify(_net(), "rank1", components=3, init="normal", predict_samples=2).eval()
    full = bnn.member_logits(X, max_rows=4096)
    chunked = bnn.member_logits(X, max_rows=5)  # one member per forward
    torch.testing.assert_close(full, chunked)
    assert full.shape == (6, 5, 3)
    assert not torch.allclose(full[0], full[1])  # two samples of member 0 differ
    with bnn.deterministic():
        means = bnn.member_logits(X)
    torch.testing.assert_close(means[0], means[1])  # deterministic: samples collapse to the mean


def test_batchensemble_fast_weight_lr_groups_and_fit() -> None:
    bnn = bayesify(_net(), "batchensemble", components=2, fast_lr_mult=0.25)
    opt = build_optimizer(bnn, lr=0.4, base_lr=1e-3, optimizer="sgd", momentum=0.9,
                          weight_decay=0.0, base_weight_decay=0.0)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"fast_weights": 0.1, "posterior": 0.4, "base": 1e-3}
    fast = {id(p) for g in opt.param_groups if g["name"] == "fast_weights" for p in g["params"]}
    assert fast == {id(p) for layer in bnn.bayesian_layers().values() for p in (layer.r, layer.s)}
    loader = DataLoader(TensorDataset(X, Y), batch_size=5)
    result = fit(bnn, loader, epochs=2, progress=False, lr_schedule="cosine")
    assert len(result) == 2 and result.last["kl"] == 0.0


def test_member_batchnorm_routes_rows_and_restores() -> None:
    net = _net()
    bnn = bayesify(net, "batchensemble", components=2, init="ones", per_member_bn=True)
    mbn = bnn.model.bn
    assert isinstance(mbn, MemberBatchNorm)
    with torch.no_grad():
        mbn.member_weight[1].mul_(2.0)
        mbn.member_running_mean[1].add_(0.3)
    h = torch.randn(4, 4, 3, 3)
    comp = torch.tensor([0, 1, 1, 0])
    with torch.no_grad(), bnn.context.use(comp):
        got = mbn(h)
    for row, k in enumerate(comp.tolist()):
        want = F.batch_norm(h[row:row + 1], mbn.member_running_mean[k], mbn.member_running_var[k],
                            mbn.member_weight[k], mbn.member_bias[k], False, 0.0, mbn.eps)
        torch.testing.assert_close(got[row:row + 1], want, rtol=1e-5, atol=1e-5)
    # BN training switched on: each member updates only its own statistics
    bnn.bn_train = True
    bnn.train()
    before = mbn.member_running_mean.clone()
    with torch.no_grad(), bnn.context.use(torch.zeros(4, dtype=torch.long)):
        mbn(h)
    assert not torch.equal(mbn.member_running_mean[0], before[0])
    assert torch.equal(mbn.member_running_mean[1], before[1])
    # unwrap puts the pretrained BN back, bit for bit
    restored = bnn.unwrap()
    assert isinstance(restored.bn, nn.BatchNorm2d)
    for key, value in net.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value)
    assert any(n.endswith("bn.member_weight") for n, _ in bnn.named_posterior_parameters())


def test_dropout_masks_per_member_and_identity() -> None:
    net = _net()
    bnn = bayesify(net, "dropout", p=0.3, predict_samples=4, skip_input_layer=False).eval()
    with torch.no_grad(), bnn.deterministic():
        torch.testing.assert_close(bnn(X), net(X))
    a, b = bnn.member_logits(X), bnn.member_logits(X, max_rows=5)
    torch.testing.assert_close(a, b)  # members are fixed thinned networks
    assert not torch.allclose(a[0], a[1])
    layer = bnn.model.conv
    x = torch.ones(4000, 2, 3, 3)
    dropped = layer.drop(x)
    assert abs((dropped == 0).float().mean().item() - 0.3) < 0.02
    torch.testing.assert_close(dropped.mean(), torch.tensor(1.0), rtol=0, atol=0.02)  # unbiased
    chan = bayesify(net, "dropout", p=0.5, granularity="channel",
                    skip_input_layer=False).model.conv.drop(x)
    assert torch.equal(chan.amin((2, 3)), chan.amax((2, 3)))  # one mask per channel, shared over pixels


def test_dropout_trains_copy_not_base() -> None:
    net = _net()
    bnn = bayesify(net, "dropout", p=0.1, train_weights=True)
    fit(bnn, DataLoader(TensorDataset(X, Y), batch_size=5), epochs=2, lr=0.1, progress=False)
    assert not torch.equal(bnn.model.conv.variational_weight, net.conv.weight)
    assert torch.equal(bnn.unwrap().conv.weight, net.conv.weight)


def test_ensemble_members_are_independent() -> None:
    """Tiled training = M independent fine-tunings: member k's gradient is ∇L_k / M."""
    bnn = bayesify(_net(), "ensemble", components=3, init_noise=0.1)
    logits, targets = bnn.training_forward(X, Y)
    F.cross_entropy(logits, targets).backward()
    grads = [layer.member_weight.grad.clone() for layer in bnn.bayesian_layers().values()]
    for k in range(3):
        for layer in bnn.bayesian_layers().values():
            layer.member_weight.grad = None
        with bnn.context.use(torch.full((5,), k)):
            (F.cross_entropy(bnn.model(X), Y) / 3).backward()
        for g, layer in zip(grads, bnn.bayesian_layers().values()):
            torch.testing.assert_close(g[k], layer.member_weight.grad[k], rtol=1e-4, atol=1e-6)
            others = [j for j in range(3) if j != k]
            assert layer.member_weight.grad[others].abs().sum() == 0
    heads = bayesify(_net(), "ensemble", components=2).model.fc.member_weight
    assert not torch.allclose(heads[0], heads[1])  # random head per member
    # unsorted rows are routed to the right member
    layer = bnn.model.fc
    h = torch.randn(4, 4)
    comp = torch.tensor([2, 0, 2, 1])
    with torch.no_grad(), bnn.context.use(comp):
        got = layer(h)
    want = torch.stack([F.linear(h[i], layer.member_weight[k], layer.member_bias[k]) for i, k in enumerate(comp)])
    torch.testing.assert_close(got, want)
    assert isinstance(layer, EnsembleLayer)


def test_snapshot_ensemble_collects_cycles() -> None:
    net = _net()
    bnn = bayesify(net, "ensemble", components=3, snapshot=True)
    assert isinstance(bnn.method.step(), SnapshotStep)  # SGD steps of the one loop, one member per cycle
    loader = DataLoader(TensorDataset(X.repeat(2, 1, 1, 1), Y.repeat(2)), batch_size=5)
    result = fit(bnn, loader, epochs=3, lr=0.05, progress=False)
    assert result.last["snapshots"] == 3 and sum(r["steps"] for r in result.history) == 6
    w = bnn.model.fc.member_weight
    assert not torch.allclose(w[0], w[1]) and not torch.allclose(w[1], w[2])
    assert not torch.allclose(w[0], net.fc.weight)
    assert bnn.predictor()(X).member_logits.shape == (3, 5, 3)


def test_identity_on_torchvision_resnet18() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        for method, per_member_bn in (("rank1", False), ("batchensemble", True)):
            bnn = bayesify(model, method, init="ones", components=2, per_member_bn=per_member_bn).eval()
            with bnn.deterministic():
                torch.testing.assert_close(bnn(x), want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(bnn.member_logits(x)[1], want, rtol=1e-4, atol=1e-4)


def test_identity_on_timm_vit_tiny() -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        want = model(x)
        for method in ("rank1", "batchensemble"):
            bnn = bayesify(model, method, init="ones", components=2).eval()
            assert len(bnn.bayesian_layers()) > 40  # qkv, proj, fc1, fc2 of 12 blocks + patch embed + head
            with bnn.deterministic():
                torch.testing.assert_close(bnn(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["rank1", "batchensemble"])
def test_the_rank_one_kl_of_the_model_equals_the_sum_over_layers(method):
    """RankOneLayer.kl_many (one computation over the concatenated factors) = Σ layer.kl()."""
    import torchvision

    torch.manual_seed(0)
    bnn = bayesify(torchvision.models.resnet18(num_classes=10), method)
    layers = list(bnn.bayesian_layers().values())
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters(recurse=False):
                p.add_(0.1 * torch.randn_like(p))
    brute = sum(layer.kl() for layer in layers)
    torch.testing.assert_close(bnn.kl(), brute.float(), rtol=1e-5, atol=1e-4)
    if method == "rank1":
        assert float(brute) > 0
        grads = torch.autograd.grad(bnn.kl(), [layers[0].r, layers[-1].s_rho])
        reference = torch.autograd.grad(sum(layer.kl() for layer in layers),
                                        [layers[0].r, layers[-1].s_rho])
        for got, want in zip(grads, reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["ibnn", "rank1", "batchensemble", "ensemble"])
def test_a_tiled_training_step_keeps_channels_last(method):
    """Tiling the batch kept its memory format: ``Tensor.repeat`` made channels_last inputs
    NCHW, so every convolution of a channels_last network converted its activations (an H100
    profile of the iBNN ResNet-50 step: one activation-sized copy per convolution)."""
    import torchvision

    from bayesify.train.steps import TrainForward

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=10).to(memory_format=torch.channels_last)
    bnn = bayesify(net.eval(), method)
    bnn.train()
    formats: list[bool] = []
    wrapped = [m for m in bnn.bayesian_layers().values()][:3]  # the first convolutions

    def seen(_module, args):
        if args[0].dim() == 4:
            formats.append(args[0].is_contiguous(memory_format=torch.channels_last))

    hooks = [m.register_forward_pre_hook(seen) for m in wrapped]
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    nll, _ = TrainForward(bnn, torch.Generator().manual_seed(0))((x,), {}, torch.arange(4))
    for hook in hooks:
        hook.remove()
    assert formats and all(formats), formats
    assert torch.isfinite(nll)
