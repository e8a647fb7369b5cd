"""Decoder classifiers (transformers' ``GPT2ForSequenceClassification``, Llama's, Qwen's):
the classifier ``score`` runs at every position, ``[B, L, C]``, and the model gathers the
last non-padding token's row. Last-layer Laplace reads the features at the position whose
output gives the logits (``core.outputs.classifier_rows``). Before, ``laplace`` with every
default failed on the first batch ("needs the wrapped Linear to produce the model's logits",
benchmarks/results/session31.md §2.3).

The decoder's Laplace equals, to rounding, the Laplace of the same network with the gather
*before* its classifier (an ordinary ``[B, C]`` classifier on the same features); the export
equals in-process; ``classifier_rows`` finds planted rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bayesify import bayesify, fit
from bayesify.core.outputs import classifier_rows

transformers = pytest.importorskip("transformers")


def test_classifier_rows_finds_the_gathered_position_up_to_a_row_constant():
    g = torch.Generator().manual_seed(0)
    a, out = torch.randn(6, 5, 4, generator=g), torch.randn(6, 5, 3, generator=g)
    position = torch.tensor([4, 0, 2, 3, 1, 4])
    rows = torch.arange(6)
    logits = out[rows, position] + torch.randn(6, 1, generator=g)  # a log_softmax after it
    got_a, got_out = classifier_rows(a, out, logits)
    assert torch.equal(got_a, a[rows, position]) and torch.equal(got_out, out[rows, position])
    flat_a, flat_out = a[:, 0], out[:, 0]  # an ordinary [B, C] classifier: as it is
    assert classifier_rows(flat_a, flat_out, flat_out)[0] is flat_a


class Tokens(Dataset):
    def __init__(self, n: int, seed: int, length: int = 10) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        ids = torch.randint(5, 60, (n, length), generator=g)
        ids[:, 0] = self.y + 1
        lens = torch.randint(4, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length)[None] < lens[:, None]).long()
        self.ids = torch.where(self.mask.bool(), ids, torch.zeros_like(ids))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.y[i]}


def _decoder() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=60, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  num_labels=3, pad_token_id=0)
    return transformers.GPT2ForSequenceClassification(cfg).eval()


class GatherFirst(nn.Module):
    """The same network, the last non-padding token gathered *before* the classifier."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.transformer, self.score = decoder.transformer, decoder.score

    def forward(self, input_ids, attention_mask):
        h = self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        last = (input_ids != 0).long().cumsum(-1).argmax(-1)  # the last non-padding token
        return self.score(h[torch.arange(len(h)), last])


def _inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def test_decoder_laplace_is_the_laplace_of_the_gathered_classifier(tmp_path):
    decoder = _decoder()
    train = DataLoader(Tokens(96, 0), batch_size=32)
    batch = _inputs(next(iter(DataLoader(Tokens(8, 1), batch_size=8))))
    with torch.no_grad():
        torch.testing.assert_close(GatherFirst(decoder)(**batch), decoder(**batch).logits)
    options = {"prior_method": "fixed", "prior_precision": 1.0, "feature_layers": None}
    ours = bayesify(decoder, "laplace", **options)
    fit(ours, train, progress=False)
    theirs = bayesify(GatherFirst(decoder), "laplace", **options)
    fit(theirs, train, progress=False)
    assert ours.method.config.structure == theirs.method.config.structure
    got, want = ours.predictor()(batch), theirs.predictor()(batch)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-5, atol=1e-6)
    assert float(got.epistemic.max()) > 1e-4  # a spread, not the MAP
    from bayesify.predict.export import export_predictor, run_exported

    path = tmp_path / "decoder.pt2"
    export_predictor(ours.predictor(), path, batch)
    probs, epistemic = run_exported(path, batch)
    torch.testing.assert_close(probs, got.probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(epistemic, got.epistemic, rtol=1e-4, atol=1e-5)


def test_every_default_fits_a_decoder_classifier_with_validation():
    bnn = bayesify(_decoder(), "laplace")
    fit(bnn, DataLoader(Tokens(96, 0), batch_size=32),
        val_loader=DataLoader(Tokens(64, 2), batch_size=32), progress=False)
    probs = bnn.predictor()(_inputs(next(iter(DataLoader(Tokens(8, 1), batch_size=8))))).probs
    assert torch.isfinite(probs).all() and probs.shape == (8, 3)


def _fitted(net: nn.Module, family: str, seed: int = 0):
    torch.manual_seed(seed)
    bnn = bayesify(net, family)
    bnn.record = fit(bnn, DataLoader(Tokens(96, 0), batch_size=32),
                     val_loader=DataLoader(Tokens(64, 2), batch_size=32), epochs=1,
                     progress=False)
    return bnn


@pytest.mark.parametrize("family", ["ibnn", "swag", "rank1"])
def test_member_wise_heads_on_a_decoder_are_those_of_the_gathered_classifier(family):
    """Every family's member-wise Laplace heads (on by default) read the classifier's input at
    the gathered position, as the laplace family does: the same posterior and predictive as
    the network with the gather before its classifier. Before, the heads were turned off on
    decoders ("gives (4, 10, 3), not the model's logits (4, 3)") and the families predicted
    without the spread that grows off the data."""
    from bayesify.kit import laplace_heads

    ours, theirs = _fitted(_decoder(), family), _fitted(GatherFirst(_decoder()), family)
    assert laplace_heads.fitted(ours) and laplace_heads.fitted(theirs)
    assert ours.record[-1]["heads_prior_precision"] == theirs.record[-1]["heads_prior_precision"]
    batch = _inputs(next(iter(DataLoader(Tokens(8, 1), batch_size=8))))
    got, want = ours.predictor()(batch), theirs.predictor()(batch)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.epistemic, want.epistemic, rtol=1e-4, atol=1e-6)


def test_decoder_heads_export_equals_in_process_and_epinet_fits_its_heads(tmp_path):
    from export_check import assert_export_matches

    from bayesify.kit import laplace_heads

    batch = _inputs(next(iter(DataLoader(Tokens(8, 1), batch_size=8))))
    bnn = _fitted(_decoder(), "ibnn")
    assert_export_matches(bnn.predictor(), tmp_path / "decoder_heads.pt2", batch)
    # the epinet's one-forward members need the classifier's output to be the logits; on a
    # decoder its members run tiled and the heads read the gathered rows like any family's
    epinet = _fitted(_decoder(), "epinet")
    assert laplace_heads.fitted(epinet)
    assert torch.isfinite(epinet.predictor()(batch).probs).all()
