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
from torch import nn

import bayesify
from bayesify.core.weight_reads import source_weight_readers

FAMILIES = {"meanfield": {}, "hypernet": {}, "mnf": {}, "dropout": {"train_weights": True},
            "rank1": {"init": "ones"}, "batchensemble": {"init": "ones"},
            "ensemble": {"init_noise": 0.0}, "ibnn": {"init_mean_std": 0.0}}


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
    with torch.no_grad():
        base = net(x)
        bnn = bayesify.bayesify(net, method=family, **FAMILIES[family]).eval()
        members = bnn.method.member_logits(bnn, x, samples_per_component=1, max_rows=1000,
                                           seed=1, deterministic=True)
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
