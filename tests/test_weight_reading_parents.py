"""A parent that computes with a child's weight instead of calling the child (Hugging Face's
WavLM attention hands ``self.q_proj.weight`` … to ``F.multi_head_attention_forward``; timm's
BEiT / EVA attention ``F.linear(x, self.qkv.weight, qkv_bias)``) bypasses any wrapper on that
child: six families failed on WavLM ("no single effective 'weight'"), the others computed
with the child's mean weight silently. Such children are found in the parent's source and
left without a posterior (thirty-eighth stop)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_own_forward_layers import IDENTITY as FAMILIES
from test_own_forward_layers import at_identity
from torch import nn

import bayesify
from bayesify.core.weight_reads import source_weight_readers


class Fused(nn.Module):
    """``qkv`` read through a helper the forward calls; ``fc`` called (and read only for a
    caller's ``states``, None by default); ``gate`` read for its dtype, and for its values
    only when ``parallel > 1``; ``spare`` read in a re-parameterisation the forward never
    calls."""

    def __init__(self, d: int = 8, parallel: int = 1) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, d)
        self.fc = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)
        self.spare = nn.Linear(d, d)
        self.extra = nn.Parameter(torch.zeros(d))
        self.parallel = parallel

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.qkv.bias + self.extra
        return F.linear(x, self.qkv.weight, bias)

    def forward(self, x: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        x = x.to(self.gate.weight.dtype) if isinstance(self.gate.weight, torch.Tensor) else x
        if self.fc.bias is not None:
            x = self._project(x)
        if states is not None:
            x = F.linear(states, self.fc.weight)
        if self.parallel > 1 and not self.training:
            x = F.linear(x, self.gate.weight)
        return self.spare(self.gate(self.fc(x)))

    def reparameterize(self) -> None:
        self.spare.weight.data.copy_(self.spare.weight.t())


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), Fused(), nn.Tanh(), nn.Linear(8, 3)).eval()


def test_only_the_child_whose_weight_the_forward_uses_is_found():
    """On the branches this module takes: ``states`` is None by default, ``parallel`` is 1
    here (2: the gate is read; ``self.training`` is not known ahead, so it counts)."""
    found = source_weight_readers(Fused())
    assert list(found) == ["qkv"]
    assert "Fused._project reads self.qkv.weight" in found["qkv"]
    assert sorted(source_weight_readers(Fused(parallel=2))) == ["gate", "qkv"]
    assert source_weight_readers(nn.Linear(2, 2)) == {}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_leaves_the_read_child_alone_and_is_the_network(family):
    net = _net()
    x = torch.randn(7, 5)
    base, bnn, members = at_identity(net, family, x)
    with torch.no_grad():
        probs = bnn.predictor(seed=1)(x).probs
    assert "2.qkv" not in bnn.targets and "2.qkv" in bnn.skipped
    assert "reads self.qkv.weight" in bnn.skipped["2.qkv"]
    assert {"2.fc", "2.gate", "2.spare"} <= set(bnn.targets)
    for member in members:
        torch.testing.assert_close(member, base, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(probs).all()


def test_a_default_fit_runs_on_the_wavlm_attention():
    """The network the crash hunt found: Hugging Face's WavLM (before, batchensemble,
    ensemble, hypernet, ibnn, mnf and rank1 raised in their first forward)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.WavLMConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, classifier_proj_size=8,
        num_labels=3, num_buckets=16, max_bucket_distance=32)
    torch.manual_seed(0)
    model = transformers.WavLMForSequenceClassification(cfg).eval()
    x = torch.randn(4, 400)
    with torch.no_grad():
        base = model(input_values=x).logits
        bnn = bayesify.bayesify(model, method="rank1", init="ones").eval()
        probs = bnn.predictor(seed=0)({"input_values": x}).probs
    skipped = [n for n in bnn.skipped if n.endswith(("q_proj", "k_proj", "v_proj", "out_proj"))]
    assert len(skipped) == 4 and not any(n in bnn.targets for n in skipped)
    torch.testing.assert_close(probs, base.softmax(-1), atol=1e-5, rtol=1e-4)


def _qat_net() -> nn.Module:
    """A small CNN prepared for quantisation-aware training: conv-BN-ReLU, conv-ReLU and
    Linear-ReLU fused, every layer's output fake-quantised by a forward hook."""
    import torch.ao.quantization as Q

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).train()
    net = Q.fuse_modules_qat(net, [["0", "1", "2"], ["3", "4"], ["7", "8"]])
    net.qconfig = Q.get_default_qat_qconfig("fbgemm")
    net = Q.prepare_qat(net)
    for _ in range(3):
        net(torch.randn(8, 3, 9, 9))
    net.apply(Q.disable_observer)
    return net.eval()


@pytest.mark.parametrize("family", ["rank1", "batchensemble", "ensemble", "dropout"])
def test_a_quantisation_aware_network_is_refused_where_a_family_would_compute_another(family):
    """Before: these families added the bias after the fused ReLU / folded BatchNorm and the
    output fake-quantisation (max |Δ logit| 0.10 at their identity point). Now every layer
    is skipped with its reason, and the refusal names one."""
    with pytest.raises(bayesify.BayesifyError, match="fused quantisation-aware ConvBnReLU2d"):
        bayesify.bayesify(_qat_net(), method=family, **FAMILIES[family])


def test_a_family_that_calls_the_layer_keeps_the_quantisation_aware_network():
    base, bnn, members = at_identity(_qat_net(), "ibnn", torch.randn(5, 3, 9, 9))
    assert set(bnn.targets) == {"0", "3", "7", "9"}
    for member in members:
        torch.testing.assert_close(member, base, atol=1e-6, rtol=1e-6)


def test_a_layer_with_its_own_forward_hook_gets_no_posterior_where_the_hook_would_be_lost():
    """A plain layer's hook never runs under a family that computes ``x Wᵀ`` itself."""
    net = _net()
    net[4].register_forward_hook(lambda _m, _i, out: out * 2.0)
    base, bnn, members = at_identity(net, "rank1", torch.randn(7, 5))
    assert "4" not in bnn.targets and "forward hooks of its own" in bnn.skipped["4"]
    torch.testing.assert_close(members[0], base, atol=1e-5, rtol=1e-5)


def test_old_style_weight_and_spectral_norm_stay_targets():
    """Their pre-hooks recompute ``weight`` before a forward; a family computes with the
    weight they left, as the layer does — these layers stay targets and are the network."""
    torch.manual_seed(0)
    net = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 8)), nn.ReLU(),
                        torch.nn.utils.spectral_norm(nn.Linear(8, 3))).eval()
    base, bnn, members = at_identity(net, "rank1", torch.randn(5, 4))
    assert bnn.targets == ["0", "2"]
    torch.testing.assert_close(members[0], base, atol=1e-6, rtol=1e-6)


class VectorTest(nn.Module):
    """A branch on a vector parameter's truth value: unknown ahead, both branches count."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale == 1:
            return self.fc(x)
        return F.linear(x, self.fc.weight)


def test_a_branch_on_a_tensor_counts_both_ways_instead_of_failing():
    assert list(source_weight_readers(VectorTest())) == ["fc"]
