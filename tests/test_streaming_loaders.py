"""A training loader over a stream (``IterableDataset``: WebDataset, Hugging Face streaming
datasets — how ImageNet-scale data is often read).

Found by fitting every family on one (thirty-third stop): ten of twelve families failed at
the start of ``fit`` with a bare ``TypeError: object of type 'Stream' has no len()`` (the
KL term's N_train is ``len(loader.dataset)``); given ``n_train=N`` they ran, but the
default budget fell to one epoch because the loader has no length, though the budget counts
examples (8,192 forward passes), not batches. Now: a clear ``BayesifyError`` asking for
``n_train`` before anything trains, and with it the same default epochs as a map-style
loader of the same examples.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from bayesify import BayesifyError, bayesify, fit
from bayesify.train.budget import default_epochs


class _Stream(IterableDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(len(self.y)):
            yield self.x[i], self.y[i]


def _data(n: int = 200):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)).eval()


def test_a_stream_without_n_train_is_refused_before_anything_trains():
    x, y = _data()
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bnn = bayesify(model, "meanfield")
    start = {k: v.clone() for k, v in bnn.state_dict().items()}
    with pytest.raises(BayesifyError, match=r"n_train=N"):
        fit(bnn, DataLoader(_Stream(x, y), batch_size=32), progress=False)
    assert all(torch.equal(start[k], v) for k, v in bnn.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in bnn.unwrap().state_dict().items())


def test_the_default_budget_counts_examples_not_batches(library_budget):
    known = default_epochs(batches_per_epoch=7, grad_accum_steps=1, n_train=200, step=None,
                           min_steps=None)[0]
    unknown = default_epochs(batches_per_epoch=0, grad_accum_steps=1, n_train=200, step=None,
                             min_steps=None)[0]
    assert known == unknown > 1


def test_a_stream_with_n_train_gets_the_map_style_loaders_epochs(library_budget):
    x, y = _data()
    stream = DataLoader(_Stream(x, y), batch_size=32)
    mapped = DataLoader(TensorDataset(x, y), batch_size=32)
    runs = []
    for loader in (stream, mapped):
        bnn = bayesify(_model(), "meanfield")
        result = fit(bnn, loader, progress=False, n_train=len(y), seed=0)
        runs.append((len(result.history), bnn.predictor(seed=0)(x[:16]).probs))
    assert runs[0][0] == runs[1][0] > 1
    # the same examples in the same order: the same posterior
    assert torch.allclose(runs[0][1], runs[1][1], atol=1e-5)


@pytest.mark.parametrize("which", ["train", "val"])
def test_a_one_shot_iterator_is_refused_with_what_to_pass(which):
    """A generator was read once for the first batch's checks; the epoch then found it
    empty and ``fit`` said "the training loader produced no batches"."""
    x, y = _data()
    batches = list(DataLoader(TensorDataset(x, y), batch_size=32))
    bnn = bayesify(_model(), "meanfield")
    start = {k: v.clone() for k, v in bnn.state_dict().items()}
    loaders = {"train": (b for b in batches), "val": None}
    if which == "val":
        loaders = {"train": batches, "val": iter(batches)}
    with pytest.raises(BayesifyError, match=r"one-shot iterator.*DataLoader, or a list"):
        fit(bnn, loaders["train"], val_loader=loaders["val"], progress=False, epochs=1)
    assert all(torch.equal(start[k], v) for k, v in bnn.state_dict().items())
    with pytest.raises(TypeError, match="iterable of batches"):
        fit(bnn, 3, progress=False)


def test_ddp_streams_of_unequal_length_end_each_epoch_together(tmp_path):
    """Two ranks, each streaming its own shard (six batches and four): every epoch ends on
    both after four steps, with one warning that says so, and the ranks end identical (before,
    rank 0 waited in its fifth step's gradient all-reduce for rank 1, which had ended its
    epoch: the collective timed out)."""
    from test_ddp import ROOT, torchrun

    proc = torchrun(ROOT / "tests" / "ddp_scripts" / "fit_stream.py", str(tmp_path))
    assert proc.stderr.count("ended at different lengths") == 1  # rank 0 speaks, once
    assert "stopped on every rank after 4 batch(es)" in proc.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == [4, 4]
    for name, tensor in ranks[0]["posterior"].items():
        assert torch.isfinite(tensor).all() and torch.equal(tensor, ranks[1]["posterior"][name])
