"""iBNN identities, node counts, KL closed form and sampling layout."""

import math

import pytest
import timm
import torch
import torchvision
from torch import nn

from bayesify import bayesify
from bayesify.methods.ibnn.layers import gaussian_kl

MODELS = {
    "tv_resnet18": (lambda: torchvision.models.resnet18(), 64),
    "tv_resnet50": (lambda: torchvision.models.resnet50(), 64),
    "tv_vgg16": (lambda: torchvision.models.vgg16(), 32),
    "tv_alexnet": (lambda: torchvision.models.alexnet(), 64),
    "timm_resnet18": (lambda: timm.create_model("resnet18", pretrained=False), 64),
    "timm_vit_tiny": (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False), 224),
    "timm_convnext_atto": (lambda: timm.create_model("convnext_atto", pretrained=False), 64),
    "tv_mobilenet_v3": (lambda: torchvision.models.mobilenet_v3_small(), 64),
    "timm_efficientnet_b0": (lambda: timm.create_model("efficientnet_b0", pretrained=False), 64),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_zero_noise_deterministic_reproduces_base(name):
    ctor, size = MODELS[name]
    torch.manual_seed(0)
    model = ctor().eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        ref = model(x)
    bnn = bayesify(model, "ibnn", components=3, init_mean_std=0.0).eval()
    with torch.no_grad(), bnn.deterministic():
        out = bnn(x)
        members = bnn.member_logits(x, samples_per_component=2)
    assert (out - ref).abs().max().item() <= 1e-6
    # tiled batches may pick another conv algorithm: equal up to float rounding
    assert (members - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    assert sum(p.numel() for p in bnn.posterior_parameters()) == 2 * 3 * bnn.num_nodes()


@pytest.mark.parametrize(
    "ctor,nodes",
    [(torchvision.models.resnet50, 24_579), (torchvision.models.alexnet, 18_307),
     (torchvision.models.vgg16, 36_995)],
)
def test_node_counts_match_paper(ctor, nodes):
    model = ctor()
    expected = sum(m.in_channels if isinstance(m, nn.Conv2d) else m.in_features
                   for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    bnn = bayesify(model, "ibnn", components=1)
    assert bnn.num_nodes() == expected == nodes
    assert sum(p.numel() for p in bnn.posterior_parameters()) == 2 * nodes
    bnn4 = bayesify(model, "ibnn", components=4)
    assert sum(p.numel() for p in bnn4.posterior_parameters()) == 2 * 4 * nodes


def identity_conv(c: int) -> nn.Conv2d:
    conv = nn.Conv2d(c, c, 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.eye(c).view(c, c, 1, 1))
    return conv


def test_noise_is_per_row_per_channel_shared_over_pixels():
    torch.manual_seed(0)
    bnn = bayesify(nn.Sequential(identity_conv(4)), "ibnn", components=2, init_std=(0.3, 0.0))
    x = torch.ones(6, 4, 5, 5)
    z = bnn(x)  # = x * z (identity conv)
    assert torch.allclose(z, z[:, :, :1, :1].expand_as(z))  # shared over pixels
    assert not torch.allclose(z[0], z[2])  # rows differ (per-example noise)
    assert not torch.allclose(z[0, 0], z[0, 1])  # channels differ


def test_noise_on_tokens_is_shared_over_tokens():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(4))
    bnn = bayesify(nn.Sequential(lin), "ibnn", components=2, init_std=(0.3, 0.0))
    out = bnn(torch.ones(3, 7, 4))  # [B, N, C]
    assert torch.allclose(out, out[:, :1, :].expand_as(out))
    assert not torch.allclose(out[0], out[1])


def test_training_layout_repeats_and_round_robin():
    bnn = bayesify(nn.Sequential(identity_conv(2)), "ibnn", components=4, samples=2)
    comp = bnn.method.step().layout.components(4, torch.device("cpu"))
    assert comp.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # deterministic: row r is scaled by the mean of component r % K
    with torch.no_grad():
        bnn.model[0].mean.copy_(torch.arange(8.0).view(4, 2))
    x = torch.ones(3, 2, 1, 1)
    y = torch.zeros(3, dtype=torch.long)
    with bnn.deterministic():
        logits, targets = bnn.training_forward(x, y)
    assert logits.shape[0] == 6 and targets.tolist() == [0] * 6
    expected = torch.arange(8.0).view(4, 2)[torch.arange(6) % 4]
    assert torch.equal(logits.view(6, 2), expected)


def test_kl_matches_closed_form_reference():
    torch.manual_seed(0)
    bnn = bayesify(nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)), "ibnn", components=4,
                   prior_std=0.2, init_mean_std=0.3, init_std=(0.1, 0.05))
    total = 0.0
    for layer in bnn.bayesian_layers().values():
        k = layer.mean.shape[0]
        mu_hat = layer.mean.mean(0)
        std_hat = (layer.std.pow(2).sum(0) / k**2).sqrt()
        q = torch.distributions.Normal(mu_hat.double(), std_hat.double())
        # per_network (default): the prior 0.2 is the network's, 0.2/√2 per node of 2 layers
        p = torch.distributions.Normal(torch.ones_like(mu_hat).double(), 0.2 / math.sqrt(2))
        total += torch.distributions.kl_divergence(q, p).sum().item()
    assert math.isclose(bnn.kl().item(), total, rel_tol=1e-5)


def test_entropy_weight_subtracts_gamma_times_the_entropy_of_the_averaged_component():
    """Trinh et al. 2022: KL(q̂‖p) − γ·H[q̂], H from torch.distributions (γ = 0: the KL)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    torch.manual_seed(1)
    plain = bayesify(net, "ibnn", components=3, init_std=(0.1, 0.05))
    torch.manual_seed(1)
    regular = bayesify(net, "ibnn", components=3, init_std=(0.1, 0.05), entropy_weight=2.5)
    entropy = 0.0
    for layer in regular.bayesian_layers().values():
        k = layer.mean.shape[0]
        std_hat = (layer.std.pow(2).sum(0) / k**2).sqrt()
        entropy += torch.distributions.Normal(0.0, std_hat.double()).entropy().sum().item()
    assert math.isclose(regular.kl().item(), plain.kl().item() - 2.5 * entropy, rel_tol=1e-5)
    # the gradient of −γH pushes every std up
    regular.kl().backward()
    plain.kl().backward()
    for a, b in zip(regular.bayesian_layers().values(), plain.bayesian_layers().values(),
                    strict=True):
        assert (a.rho.grad < b.rho.grad).all()


def test_gaussian_kl_monte_carlo():
    torch.manual_seed(0)
    mu, var = torch.tensor([1.3]), torch.tensor([0.04])
    samples = mu + var.sqrt() * torch.randn(400_000)
    log_q = torch.distributions.Normal(mu, var.sqrt()).log_prob(samples)
    log_p = torch.distributions.Normal(1.0, 0.1).log_prob(samples)
    assert abs((log_q - log_p).mean().item() - gaussian_kl(mu, var, 1.0, 0.1).item()) < 0.05


def test_kl_gradient_flows_to_means_and_stds():
    bnn = bayesify(nn.Sequential(nn.Linear(5, 3)), "ibnn", components=2)
    bnn.kl().backward()
    layer = bnn.model[0]
    assert layer.mean.grad is not None and layer.rho.grad is not None


def test_predictor_members_are_fixed_networks():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    bnn = bayesify(net, "ibnn", components=3)
    pred = bnn.predictor(samples_per_component=4, seed=7)
    x = torch.randn(5, 3, 8, 8)
    a = pred.member_logits(x)
    assert a.shape == (12, 5, 5)
    assert torch.equal(a, pred.member_logits(x))  # same seed → same members
    assert torch.allclose(a[:, :2], pred.member_logits(x[:2]), atol=1e-6)  # batch-independent
    small = bnn.predictor(samples_per_component=4, seed=7, max_rows=10)
    assert torch.allclose(a, small.member_logits(x), atol=1e-6)  # chunking-independent
    other = bnn.predictor(samples_per_component=4, seed=8).member_logits(x)
    assert not torch.allclose(a, other)


def test_prediction_is_one_tiled_forward():
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 5))
    bnn = bayesify(net, "ibnn", components=4)
    calls = []
    bnn.model[1].base_layer.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    bnn.predictor(samples_per_component=5)(torch.randn(8, 12))
    assert calls == [4 * 5 * 8]


@pytest.mark.parametrize("entropy_weight", [0.0, 0.5])
def test_the_model_kl_is_one_computation_and_equals_the_sum_over_layers(entropy_weight):
    """BayesianModel.kl() concatenates the node-noise layers (NodeNoiseLayer.kl_many): the same
    value and gradients as summing every layer's own KL."""
    torch.manual_seed(0)
    bnn = bayesify(torchvision.models.resnet18(num_classes=10), "ibnn", components=3,
                   entropy_weight=entropy_weight)
    layers = list(bnn.bayesian_layers().values())
    assert len(layers) > 10
    with torch.no_grad():
        for layer in layers:
            layer.mean.add_(0.1 * torch.randn_like(layer.mean))
            layer.rho.add_(0.3 * torch.randn_like(layer.rho))
    batched = bnn.kl()
    grads = torch.autograd.grad(batched, [layers[0].mean, layers[-1].rho])
    brute = sum(layer.kl() for layer in layers)
    reference = torch.autograd.grad(brute, [layers[0].mean, layers[-1].rho])
    torch.testing.assert_close(batched, brute.float(), rtol=1e-5, atol=1e-4)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # layers that differ (another prior) are summed one by one, still exactly
    layers[0].prior_std = 0.5
    torch.testing.assert_close(bnn.kl(), sum(layer.kl() for layer in layers).float(),
                               rtol=1e-5, atol=1e-4)
