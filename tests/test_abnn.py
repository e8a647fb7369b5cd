"""ABNN (Franchi et al. 2024): the layer's equation against a brute force, σ = 0 is the
pretrained network bit for bit (BatchNorm, LayerNorm, GroupNorm, a channel-first LayerNorm
subclass), normalisation subclasses that compute something else are left alone, the prior
term and the random class-weight prior against their formulas, and the export."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesify import bayesify
from bayesify.methods.abnn.layers import BayesNormLayer, norm_axis
from bayesify.methods.abnn.method import ABNNStep, class_weights


class LayerNorm2d(nn.LayerNorm):
    """timm's channel-first LayerNorm: normalises axis 1 of ``[B, C, H, W]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class BatchNormAct(nn.BatchNorm2d):
    """An activation written into forward (no act module to apply after): not a plain norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class NormNet(nn.Module):
    """Every normalisation kind on ``[B, 2, 6, 6]`` → 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.ln2d = LayerNorm2d(8)
        self.bnact = BatchNormAct(8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bnact(self.ln2d(self.gn(F.relu(self.bn(self.conv(x))))))
        return self.fc(self.ln(h.mean((2, 3))))


def pretrained_normnet() -> nn.Module:
    torch.manual_seed(0)
    net = NormNet()
    with torch.no_grad():  # non-trivial affine parameters and statistics
        for m in net.modules():
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)):
                m.weight.copy_(1 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.2 * torch.randn_like(m.bias))
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.1 * torch.randn_like(m.running_mean))
                m.running_var.copy_(0.5 + torch.rand_like(m.running_var))
    return net.eval()


def test_targets_are_the_plain_normalisations():
    net = pretrained_normnet()
    bnn = bayesify(net, "abnn")
    assert bnn.targets == ["bn", "gn", "ln2d", "ln"]  # BatchNormAct adds a ReLU: not a target
    axes = {n: layer.axis for n, layer in bnn.bayesian_layers().items()}
    assert axes == {"bn": 1, "gn": 1, "ln2d": 1, "ln": -1}
    assert norm_axis(net.bnact) is None and norm_axis(net.fc) is None


@pytest.mark.parametrize("options", [{"noise_std": 0.0}, {"noise_std": 0.0, "components": 1}, {}])
def test_zero_noise_is_the_pretrained_network_bit_for_bit(options):
    net = pretrained_normnet()
    x = torch.randn(5, 2, 6, 6)
    with torch.no_grad():
        expected = net(x)
        bnn = bayesify(net, "abnn", **options).eval()
        if options:  # σ = 0: every member of the predictive is the network itself
            members = bnn.member_logits(x)
            assert members.shape[0] == bnn.method.components * 4
            assert all(torch.equal(m, expected) for m in members)
            assert torch.equal(bnn(x), expected)
        with bnn.deterministic():
            assert torch.equal(bnn(x), expected)
        if not options:  # the default σ > 0 does perturb the members
            assert not torch.allclose(bnn.member_logits(x)[0], expected)


def test_layer_equation_against_a_brute_force():
    """``y = γ_k·(x̂ ⊙ (1 + σ·ε)) + β_k`` for the row's member k, ε per row and channel."""
    torch.manual_seed(1)
    bn = nn.BatchNorm2d(3).eval()
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 2.0)
    net = nn.Sequential(nn.Conv2d(1, 3, 1), bn, nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).eval()
    bnn = bayesify(net, "abnn", noise_std=0.3, components=2)
    layer: BayesNormLayer = bnn.model[1]
    with torch.no_grad():
        layer.member_weight.copy_(torch.randn(2, 3))
        layer.member_bias.copy_(torch.randn(2, 3))
    x = torch.randn(4, 3, 4, 4)
    comp = torch.tensor([0, 1, 1, 0])
    with torch.no_grad(), bnn.context.use(comp, generator=torch.Generator().manual_seed(5)):
        got = layer(x)
    eps = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    xhat = (x - bn.running_mean[:, None, None]) / torch.sqrt(bn.running_var[:, None, None] + bn.eps)
    gamma = layer.member_weight[comp][:, :, None, None].detach()
    beta = layer.member_bias[comp][:, :, None, None].detach()
    expected = gamma * (xhat * (1 + 0.3 * eps[:, :, None, None])) + beta
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # the knob scales σ at prediction only
    bnn.eval()
    bnn.state.set("abnn_noise_scale", 0.0)
    with torch.no_grad():
        torch.testing.assert_close(bnn.member_logits(x[:, :1]), bnn.member_logits(x[:, :1], seed=9))


def test_prior_term_and_random_prior_against_their_formulas():
    net = pretrained_normnet()
    bnn = bayesify(net, "abnn", prior_std=0.2, random_prior=2.0, components=3)
    assert float(bnn.kl()) == 0.0  # the members start at the pretrained values
    layer = bnn.bayesian_layers()["ln"]
    with torch.no_grad():
        layer.member_weight[1] += 0.1
        layer.member_bias[2] -= 0.3
    expected = (8 * 0.1**2 + 8 * 0.3**2) / (2 * 0.2**2)
    assert abs(float(bnn.kl()) - expected) < 1e-4
    # η_kc = 1 + 2·u_kc, fixed per member; the NLL is the η-weighted mean over the rows
    eta = class_weights(3, 4, 2.0, 0)
    assert torch.equal(eta, class_weights(3, 4, 2.0, 0)) and (eta >= 1).all() and (eta < 3).all()
    step = ABNNStep(bnn.method.config, 3)
    x, y = torch.randn(6, 2, 6, 6), torch.tensor([0, 1, 2, 3, 0, 1])
    bnn.train()
    torch.manual_seed(3)
    nll, kl = step.terms(bnn, x, y)
    torch.manual_seed(3)
    logits, targets = step.forward(bnn, x, y)
    rows = torch.arange(6) % 3
    w = eta[rows, targets]
    want = (w * F.cross_entropy(logits, targets, reduction="none")).sum() / w.sum()
    torch.testing.assert_close(nll, want)
    torch.testing.assert_close(kl, bnn.kl())


@pytest.mark.slow  # ~45 s (torch.export); the default run exports abnn in test_export_architectures
def test_export_equals_in_process(tmp_path):
    from bayesify.predict.export import run_exported

    bnn = bayesify(pretrained_normnet(), "abnn", components=2, predict_samples=2).eval()
    bnn.state.set("abnn_noise_scale", 1.5)
    predictor = bnn.predictor(seed=4, temperature=1.3)
    x = torch.randn(7, 2, 6, 6)
    info = predictor.export(tmp_path / "a.pt2", x[:3])
    assert info["members"] == 4 and info["max_abs_diff"] <= 1e-5
    probs, epistemic = run_exported(tmp_path / "a.pt2", x)
    reference = predictor(x)
    torch.testing.assert_close(probs, reference.probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(epistemic, reference.epistemic, atol=1e-5, rtol=0)
    assert reference.epistemic.min() > 0


class NotFrozenBatchNorm(nn.Module):
    """Named like a frozen BatchNorm, with its buffers, computing something else."""

    def __init__(self, c: int) -> None:
        super().__init__()
        for name in ("weight", "running_var"):
            self.register_buffer(name, torch.ones(c))
        for name in ("bias", "running_mean"):
            self.register_buffer(name, torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * x


NotFrozenBatchNorm.__name__ = "FrozenBatchNorm2d"


def test_frozen_batchnorm_is_a_target_and_zero_noise_is_the_network():
    """torchvision's ``FrozenBatchNorm2d`` (γ, β and statistics as buffers; detection
    backbones, timm's ``freeze_batch_norm_2d``): wrapped like BatchNorm — before, 'no layer
    matched' — with σ = 0 the network to float rounding, and the members' γ, β train; a
    module only named so is left alone."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    from bayesify import fit

    net = pretrained_normnet()
    frozen = FrozenBatchNorm2d(8)
    for name in ("weight", "bias", "running_mean", "running_var"):
        getattr(frozen, name).copy_(getattr(net.bn, name).detach())
    net.bn = frozen
    x = torch.randn(5, 2, 6, 6)
    with torch.no_grad():
        expected = net(x)
    bnn = bayesify(net, "abnn", noise_std=0.0)
    assert bnn.targets == ["bn", "gn", "ln2d", "ln"]
    with torch.no_grad():  # to float rounding: its formula is not batch_norm's kernel
        torch.testing.assert_close(bnn.eval()(x), expected, rtol=1e-6, atol=1e-6)
    trained = bayesify(net, "abnn")
    before = trained.bayesian_layers()["bn"].member_weight.detach().clone()
    fit(trained, [(x, torch.randint(0, 4, (5,)))], n_train=5, epochs=2, progress=False)
    assert not torch.equal(trained.bayesian_layers()["bn"].member_weight.detach(), before)
    net.bn = NotFrozenBatchNorm(8)
    assert norm_axis(net.bn) is None
    assert "bn" not in bayesify(net, "abnn").targets


class _LibraryRMSNorm(nn.Module):
    """The transformer libraries' RMS normalisation (Llama's, Mistral's, Qwen's, T5's):
    ``weight`` and ``variance_epsilon``, float32 statistics."""

    def __init__(self, width: int, one_plus: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.variance_epsilon = 1e-6
        self.one_plus = one_plus  # Gemma's: γ = 1 + weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1 + self.weight) if self.one_plus else self.weight) * h.to(x.dtype)


_LibraryRMSNorm.__name__ = "LlamaRMSNorm"


def test_rms_norms_are_targets_and_zero_noise_is_the_network():
    """Every decoder LLM (Llama, Mistral, Qwen) and T5 normalise with an RMS norm: ``abnn``
    refused them all ("no layer matched", benchmarks/hf_classes.py llama). The library kind
    and ``torch.nn.RMSNorm`` are now wrapped; with σ = 0 the network exactly; the members
    train (γ, and a β from 0); Gemma's ``1 + weight`` computes something else and is left."""
    from bayesify import fit

    torch.manual_seed(0)
    torch_rms = nn.RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        torch_rms.weight.uniform_(0.5, 1.5)
    net = nn.Sequential(nn.Linear(4, 8), _LibraryRMSNorm(8), nn.GELU(), nn.Linear(8, 8),
                        torch_rms, nn.Linear(8, 3)).eval()
    x = torch.randn(6, 4)
    with torch.no_grad():
        expected = net(x)
    bnn = bayesify(net, "abnn", noise_std=0.0)
    assert bnn.targets == ["1", "4"]
    with torch.no_grad():
        torch.testing.assert_close(bnn.eval()(x), expected, rtol=0, atol=0)
    trained = bayesify(net, "abnn")
    fit(trained, [(x, torch.randint(0, 3, (6,)))], n_train=6, epochs=2, progress=False)
    layer = trained.bayesian_layers()["1"]
    assert float(layer.member_bias.detach().abs().max()) > 0  # a β the network did not have
    net[1] = _LibraryRMSNorm(8, one_plus=True)
    assert norm_axis(net[1]) is None
    assert "1" not in bayesify(net, "abnn").targets


def _norm_act_net() -> tuple[nn.Module, int]:
    """timm's norm-activation layers (EfficientNet's BatchNormAct2d with SiLU and a
    dropout module, BiT's GroupNormAct, LayerNormAct2d, FrozenBatchNormAct2d) and Hugging
    Face BiT's BitGroupNormActivation, with non-trivial statistics and affine parameters."""
    layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    norms = [layers.BatchNormAct2d(8, act_layer=nn.SiLU, drop_layer=lambda: nn.Dropout(0.1)),
             layers.GroupNormAct(8, 2, act_layer=nn.ReLU),
             layers.LayerNormAct2d(8, act_layer=nn.GELU),
             layers.FrozenBatchNormAct2d(8, act_layer=nn.ReLU)]
    try:
        from transformers import BitConfig
        from transformers.models.bit.modeling_bit import BitGroupNormActivation

        norms.append(BitGroupNormActivation(BitConfig(num_groups=2, hidden_act="relu"), 8))
    except ImportError:  # the Hugging Face extra is optional
        pass
    body = [nn.Conv2d(2, 8, 3, padding=1)]
    for norm in norms:
        body += [norm, nn.Conv2d(8, 8, 3, padding=1)]
    net = nn.Sequential(*body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.3 * torch.randn_like(norm.weight))
            norm.bias.copy_(0.2 * torch.randn_like(norm.bias))
            if getattr(norm, "running_mean", None) is not None:
                norm.running_mean.copy_(0.1 * torch.randn_like(norm.running_mean))
                norm.running_var.copy_(0.5 + torch.rand_like(norm.running_var))
    return net.eval(), len(norms)


def test_norm_activation_layers_are_targets_with_their_activation(tmp_path):
    """A norm-activation layer is the normalisation then its own ``drop``/``act`` modules:
    wrapped (it was refused: ``abnn`` wrapped 16 of EfficientNet-Lite0's 49 BatchNorms),
    σ = 0 is the network (the activation applied after the members' affine), a noisy
    member is the brute-force ``act(γ_k·x̂·(1 + σε) + β_k)`` — here checked through its
    sign: ReLU members are never negative — and the export equals in process."""
    net, count = _norm_act_net()
    x = torch.randn(5, 2, 6, 6)
    with torch.no_grad():
        expected = net(x)
    bnn = bayesify(net, "abnn", noise_std=0.0)
    assert len(bnn.targets) == count
    with torch.no_grad():  # FrozenBatchNormAct2d's own formula is not batch_norm's kernel
        torch.testing.assert_close(bnn.eval()(x), expected, rtol=1e-6, atol=1e-6)
    noisy = bayesify(net, "abnn", components=2, predict_samples=2).eval()
    noisy.state.set("abnn_noise_scale", 2.0)
    relu = noisy.bayesian_layers()[noisy.targets[1]]  # GroupNormAct with ReLU
    seen = []
    handle = relu.register_forward_hook(lambda m, i, o: seen.append(o))
    predictor = noisy.predictor(seed=4, temperature=1.3)
    with torch.no_grad():
        reference = predictor(x)
    handle.remove()
    assert seen and all(float(o.min()) >= 0.0 for o in seen)
    info = predictor.export(tmp_path / "a.pt2", x[:3])
    assert info["max_abs_diff"] <= 1e-5
    assert reference.epistemic.min() > 0
