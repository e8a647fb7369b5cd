"""Laplace on a distilled model, whose logits are the mean of two heads.

Found by running every family's defaults on timm's distilled DeiT
(``VisionTransformerDistilled``: ``head`` on the class token, ``head_dist`` on the
distillation token, averaged in eval mode) and Hugging Face's
``DeiTForImageClassificationWithTeacher`` (``cls_classifier``, ``distillation_classifier``):
``laplace`` wrapped the last Linear alone, whose output is not the logits, and its fit failed
on the first batch ("last-layer Laplace needs the wrapped Linear to produce the model's
logits") — with every default, on a common pretrained ViT. Now ``targets='last_layer'`` gives
Laplace every head the model averages (timm's ``get_classifier()`` returns them as a tuple;
Hugging Face's teacher classes name the second one) and the posterior is the diagonal
subnetwork one over both (benchmarks/results/session33.md).
"""

from __future__ import annotations

import copy

import pytest
import torch
from stress_nets import _train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit, load_posterior
from bayesify.core.walker import classifier_group
from bayesify.methods.laplace import state


class _Distilled(nn.Module):
    """Two tokens from a shared trunk, one head each, their mean in eval mode (timm's
    ``forward_head`` of ``VisionTransformerDistilled``)."""

    def __init__(self, names: tuple[str, str] = ("head", "head_dist"), timm_api: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 16)
        self.norm = nn.LayerNorm(8)
        self.names = names
        setattr(self, names[0], nn.Linear(8, 3))
        setattr(self, names[1], nn.Linear(8, 3))
        if timm_api:
            self.get_classifier = lambda: (getattr(self, names[0]), getattr(self, names[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(torch.relu(self.trunk(x)).view(len(x), 2, 8))
        first, second = (getattr(self, n) for n in self.names)
        return (first(tokens[:, 0]) + second(tokens[:, 1])) / 2


class _WithAux(nn.Module):
    """GoogLeNet's kind: an auxiliary classifier of the classifier's shape, unused in eval."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.aux_fc = nn.Linear(8, 3)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.trunk(x)))


def _data(n: int = 96, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return DataLoader(TensorDataset(x, y), batch_size=32)


def _trained(model: nn.Module) -> nn.Module:
    _train(model, *_data().dataset.tensors, steps=90, lr=1e-2, weight_decay=0.0)
    return model


def test_the_group_is_every_averaged_head_and_only_those():
    assert classifier_group(_Distilled()) == ["head", "head_dist"]
    hf = _Distilled(("cls_classifier", "distillation_classifier"), timm_api=False)
    assert classifier_group(hf) == ["cls_classifier", "distillation_classifier"]
    # an auxiliary head of the same shape is not the logits' (GoogLeNet's aux2.fc2 and fc)
    assert classifier_group(_WithAux()) == ["fc"]
    assert classifier_group(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))) == ["2"]


@pytest.mark.parametrize("names,timm_api", [(("head", "head_dist"), True),
                                             (("cls_classifier", "distillation_classifier"), False)])
@pytest.mark.parametrize("validate", [True, False])
def test_laplace_with_defaults_fits_a_distilled_model(names, timm_api, validate):
    model = _trained(_Distilled(names, timm_api))
    bnn = bayesify(model, "laplace")
    assert sorted(bnn.bayesian_layers()) == sorted(names)
    assert bnn.method.config.structure == "diag"
    fit(bnn, _data(), val_loader=_data(60, seed=1) if validate else None, progress=False)
    x, _ = next(iter(_data(32, seed=2)))
    probs = bnn.predictor()(x).probs
    assert torch.isfinite(probs).all()
    # both heads carry curvature: the posterior is over both, not over the second alone
    for layer in state.layers(bnn).values():
        assert float(layer.ggn_diag.abs().sum()) > 0
    # other families keep their one classifier
    assert list(bayesify(model, "epinet").bayesian_layers()) != sorted(names)


def test_a_distilled_laplace_at_a_huge_prior_precision_is_the_network():
    model = _trained(_Distilled())
    bnn = bayesify(model, "laplace", prior_method="fixed", prior_precision=1e12)
    fit(bnn, _data(), progress=False)
    x, _ = next(iter(_data(32, seed=2)))
    with torch.no_grad():
        expected = model(x).softmax(-1)
    got = bnn.predictor(temperature=1.0)(x).probs
    assert torch.allclose(got, expected, atol=1e-5)
    bnn.method.set_prior_precision(bnn, 1e-2)  # broad: not the network's
    broad = bnn.predictor(temperature=1.0)(x).probs
    assert (broad - expected).abs().max() > 1e-3


def test_a_distilled_laplace_saved_and_loaded_predicts_the_same(tmp_path):
    model = _trained(_Distilled())
    base = copy.deepcopy(model)
    bnn = bayesify(model, "laplace")
    fit(bnn, _data(), val_loader=_data(60, seed=1), progress=False)
    bnn.save_posterior(tmp_path / "p")
    again = load_posterior(base, tmp_path / "p")
    x, _ = next(iter(_data(32, seed=2)))
    assert torch.allclose(again.predictor()(x).probs, bnn.predictor()(x).probs, atol=1e-6)
