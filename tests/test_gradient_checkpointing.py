"""Gradient checkpointing (``torch.utils.checkpoint``; Hugging Face's
``gradient_checkpointing_enable()`` / ``TrainingArguments(gradient_checkpointing=True)``)
recomputes segments of the forward inside the backward pass, after bayesify's sampling plan
for the forward has closed. Before the thirty-fifth stop the recomputed wrapped layers dealt
their rows to other members (BatchEnsemble, rank-1: factor gradients wrong by up to 8× their
size) and drew other noise from fit's generator — silently. Now the recompute reads the plan
of the forward it recomputes; fit draws from the global RNG (which checkpointing replays) for
a model whose checkpointing it sees; a generator's noise recomputed is an error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bayesify import BayesifyError, bayesify, elbo_loss


class _Checkpointed(nn.Module):
    def __init__(self, on: bool) -> None:
        super().__init__()
        self.a, self.norm = nn.Linear(4, 8), nn.LayerNorm(8)
        self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 3)
        self.on = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        segment = lambda t: torch.relu(self.b(self.norm(t)))
        h = checkpoint(segment, h, use_reentrant=False) if self.on else segment(h)
        return self.c(h)


def _grads(family: str, on: bool, generator: torch.Generator | None = None) -> dict:
    torch.manual_seed(0)
    net = _Checkpointed(on).eval()
    torch.manual_seed(1)
    bnn = bayesify(net, family)
    bnn.train()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    torch.manual_seed(2)
    elbo_loss(bnn, (x, y), n_train=100, generator=generator).loss.backward()
    return {n: p.grad.clone() for n, p in bnn.named_posterior_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["batchensemble", "rank1", "ibnn", "meanfield", "abnn"])
def test_the_recomputed_forward_is_the_forward_the_loss_saw(family):
    plain, recomputed = _grads(family, False), _grads(family, True)
    assert plain.keys() == recomputed.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=name)


def test_noise_from_a_generator_is_refused_when_recomputed():
    with pytest.raises(BayesifyError, match="gradient checkpointing"):
        _grads("ibnn", True, generator=torch.Generator().manual_seed(5))
    assert _grads("ibnn", False, generator=torch.Generator().manual_seed(5))  # not recomputed


def test_fit_of_a_hugging_face_model_with_checkpointing_is_the_fit_without_it(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import DataLoader

    from bayesify import fit
    from bayesify.train import loop

    model, rows = _tiny_bert(transformers)

    def fitted(net: nn.Module) -> dict:
        torch.manual_seed(1)
        bnn = bayesify(net, "ibnn")
        start = {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}
        fit(bnn, DataLoader(rows, batch_size=8), epochs=1, seed=0, progress=False)
        after = {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}
        assert max(float((after[n] - v).abs().max()) for n, v in start.items()) > 0
        return after

    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    assert loop.gradient_checkpointing(checkpointed)
    ours = fitted(checkpointed)
    # the same fit without checkpointing, drawing from the global RNG as fit then does
    monkeypatch.setattr(loop, "gradient_checkpointing", lambda _model: True)
    theirs = fitted(copy.deepcopy(model))
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_bayes_trainer_with_gradient_checkpointing_trains_as_without(tmp_path):
    """``TrainingArguments(gradient_checkpointing=True)``: ``Trainer`` asks the model it
    trains — the ``BayesianModel`` — to enable checkpointing; before the thirty-fifth stop
    that was an ``AttributeError``. Now the wrapped model's own, non-reentrant (the
    reentrant kind leaves the posterior inside checkpointed blocks without gradient): the
    same posterior as without checkpointing."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from bayesify.integrations.hf import BayesTrainer

    model, rows = _tiny_bert(transformers)
    trained = []
    for checkpointing in (False, True):
        torch.manual_seed(1)
        bnn = bayesify(copy.deepcopy(model), "batchensemble")
        start = {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(checkpointing)), num_train_epochs=1,
            per_device_train_batch_size=8, report_to=[], use_cpu=True, save_strategy="no",
            gradient_checkpointing=checkpointing, seed=0, data_seed=0)
        BayesTrainer(model=bnn, args=args, train_dataset=rows).train()
        assert any(getattr(m, "gradient_checkpointing", False) for m in bnn.model.modules()) \
            == checkpointing
        after = {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}
        layer = "bert.encoder.layer.1.output.dense.s"  # inside a checkpointed block
        assert float((after[layer] - start[layer]).abs().max()) > 0
        trained.append(after)
    for name, value in trained[0].items():
        torch.testing.assert_close(trained[1][name], value, rtol=1e-6, atol=1e-7, msg=name)


def _tiny_bert(transformers) -> tuple[nn.Module, list[dict]]:
    """A random-init two-layer BERT classifier and 32 labelled token rows."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16, num_labels=3)
    model = transformers.BertForSequenceClassification(config).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (32, 8), generator=g)
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": ids[i, 1] % 3} for i in range(32)]
    return model, rows


def test_fit_of_a_timm_model_with_grad_checkpointing_is_the_fit_without_it(monkeypatch):
    """timm's ``set_grad_checkpointing()`` (a ``grad_checkpointing`` flag): seen by ``fit``
    as Hugging Face's is; before, the recompute drew other noise (and, with the guard of this
    stop alone, refused it)."""
    timm = pytest.importorskip("timm")
    from torch.utils.data import DataLoader, TensorDataset

    from bayesify import fit
    from bayesify.train import loop

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3,
                              img_size=32, patch_size=8, depth=2).eval()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 3, (16,), generator=g))

    def fitted(net: nn.Module) -> dict:
        torch.manual_seed(1)
        bnn = bayesify(net, "rank1")
        fit(bnn, DataLoader(data, batch_size=8), epochs=1, seed=0, progress=False)
        return {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}

    checkpointed = copy.deepcopy(model)
    checkpointed.set_grad_checkpointing(True)
    assert loop.gradient_checkpointing(checkpointed) and not loop.gradient_checkpointing(model)
    ours = fitted(checkpointed)
    monkeypatch.setattr(loop, "gradient_checkpointing", lambda _model: True)
    theirs = fitted(copy.deepcopy(model))
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)
