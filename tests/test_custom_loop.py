"""``bayesify.elbo_loss`` in a hand-written loop equals ``fit`` (issue 14, custom loops)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, elbo_loss, fit
from tests.test_registry_state import loader, model


def hand_written_loop(bnn, data, *, epochs: int = 2, n_train: int = 40):
    """``epochs`` of ``elbo_loss`` steps as ``fit(lr=0.05, lr_schedule="constant")`` takes
    them for the ensemble (SGD Nesterov, the gradient norm clipped at 1)."""
    opt = torch.optim.SGD(bnn.posterior_parameters(), lr=0.05, momentum=0.9, nesterov=True)
    bnn.train()
    for _ in range(epochs):
        for x, y in data:
            terms = elbo_loss(bnn, (x, y), n_train=n_train)
            opt.zero_grad()
            terms.loss.backward()
            torch.nn.utils.clip_grad_norm_(list(bnn.posterior_parameters()), 1.0)
            opt.step()
    return bnn


def test_hand_written_loop_matches_fit():
    data = loader(n=40, batch=8)  # sequential order: fit's seeded order is the same
    by_fit = bayesify(model(), "ensemble")
    # the ensemble's defaults: cosine rate (here constant, to write the loop plainly) and the
    # gradient norm clipped at 1 (below)
    fit(by_fit, data, epochs=2, lr=0.05, lr_schedule="constant", seed=0, progress=False)

    mine = hand_written_loop(bayesify(model(), "ensemble"), data)
    for (name, a), (_, b) in zip(by_fit.named_posterior_parameters(),
                                 mine.named_posterior_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_elbo_loss_terms_and_mapping_batches():
    bnn = bayesify(model(), "ibnn")
    x, y = loader(n=8).dataset.tensors

    class Named(torch.nn.Module):  # a model called with keyword inputs (HF style)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            return self.inner(pixel_values)

    named = bayesify(Named(model()), "ibnn")
    torch.manual_seed(0)
    a = elbo_loss(named, {"pixel_values": x, "labels": y}, n_train=100, beta=0.5)
    assert torch.isfinite(a.loss) and a.kl > 0
    assert torch.allclose(a.loss, a.nll + 0.5 * a.kl / 100)
    with pytest.raises(BayesifyError, match="n_train"):
        elbo_loss(bnn, (x, y), n_train=0)
    with pytest.raises(BayesifyError, match="labels"):
        elbo_loss(bnn, x, n_train=10)


def test_every_entry_point_takes_mapping_batches():
    """fit, predictor(**inputs)/predictor(mapping), calibrate, evaluate, acquisition.select
    and evaluation.report on a loader of HF-style mappings with 'labels'."""
    from bayesify.acquisition import select
    from bayesify.evaluation import report

    class Named(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, features):
            return self.inner(features)

    x, y = loader(n=16).dataset.tensors
    rows = [{"features": a, "labels": b} for a, b in zip(x, y)]
    data = DataLoader(rows, batch_size=4)
    bnn = bayesify(Named(model()), "ibnn")
    fit(bnn, data, progress=False, n_train=1000)
    pred = bnn.predictor()
    assert torch.equal(pred(features=x[:3]).probs, pred({"features": x[:3]}).probs)
    pred.calibrate(data)
    assert pred.evaluate(data)["n"] == 16
    assert select(pred, data, k=3).shape == (3,)
    with pytest.warns(UserWarning, match="only the clean"):
        table = report({"ibnn": pred}, {"test": data})
    assert [r["evaluation"] for r in table] == ["clean"]
    with pytest.raises(BayesifyError, match="batch_fn"):
        fit(bnn, DataLoader(TensorDataset(x, x, y), batch_size=4), progress=False)
