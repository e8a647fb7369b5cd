"""Posterior state for every registered family (parametrised over ``list_methods()``).

With every option at its default (SWAG and ensembles get enough steps): fit a small
CNN with BatchNorm, then

- ``unwrap()`` is the original network bit for bit, and fitting never touched it;
- ``save_posterior`` + ``load_posterior(original, dir)`` predicts exactly as the
  fitted model (probabilities, epistemic part), temperature included;
- a run killed after epoch 1 and resumed from its checkpoint equals the
  uninterrupted run;
- with ``base_lr > 0`` the changed base tensors travel with the posterior.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit, list_methods, load_posterior
from tests.test_registry_shared import NUM_CLASSES, SmallCNN, _with_stats

METHODS = list_methods()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _with_stats(SmallCNN())


def loader(n: int = 48, seed: int = 0, batch: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def epochs(bnn) -> dict:
    """2 epochs for gradient families; Laplace makes one pass (epochs do not apply). The
    48 examples stand for a sample of a realistic data set (the KL is weighted per
    training example: N = 5000), which is what these state tests are about."""
    return {} if not bnn.method.step().optimizes else {"epochs": 2, "n_train": 5000}


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("method", METHODS)
def test_fit_save_load_onto_the_original_base(method, tmp_path):
    base = model()
    original = copy.deepcopy(base)
    bnn = bayesify(base, method)
    fit(bnn, loader(), val_loader=loader(24, seed=1), progress=False, **epochs(bnn))
    assert same_state(bnn.unwrap(), original) and same_state(base, original)
    predictor = bnn.predictor()
    predictor.temperature = 1.5  # stored with the posterior
    x = loader(10, seed=2).dataset.tensors[0]
    want = predictor(x)
    bnn.save_posterior(tmp_path)
    again = load_posterior(copy.deepcopy(original), tmp_path)
    got = again.predictor()(x)
    assert again.predictor().temperature == 1.5
    assert torch.equal(want.probs, got.probs) and torch.equal(want.epistemic, got.epistemic)


@pytest.mark.parametrize("method", METHODS)
def test_resume_equals_uninterrupted(method, tmp_path):
    class Kill(Exception):
        pass

    def kill(state, record):
        if state.epoch == 1:
            raise Kill

    def run(**kw):
        bnn = bayesify(model(), method)
        fit(bnn, loader(), seed=7, progress=False, **epochs(bnn), **kw)
        return bnn

    if not bayesify(model(), method).method.step().optimizes:  # one pass: resume skips it
        full = bayesify(model(), method)
        fit(full, loader(), checkpoint_dir=tmp_path, progress=False)
        resumed = bayesify(model(), method)
        fit(resumed, [], resume=tmp_path, progress=False)
    else:
        full = run()
        with pytest.raises(Kill):
            run(checkpoint_dir=tmp_path, callbacks=[kill])
        resumed = run(checkpoint_dir=tmp_path, resume=tmp_path)
    a, b = full.posterior_tensors(), resumed.posterior_tensors()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name].double(), b[name].double(), atol=1e-6), name


@pytest.mark.parametrize("method", ["ibnn", "swag"])
def test_fine_tuned_base_travels_with_the_posterior(method, tmp_path):
    base = model()
    original = copy.deepcopy(base)
    bnn = bayesify(base, method)
    fit(bnn, loader(), epochs=2, base_lr=0.05, progress=False)
    tuned = bnn.unwrap()  # documented: the fine-tuned base when base_lr > 0
    assert not same_state(tuned, original)
    bnn.save_posterior(tmp_path)
    again = load_posterior(copy.deepcopy(original), tmp_path)
    assert same_state(again.unwrap(), tuned)
    x = loader(10, seed=2).dataset.tensors[0]
    assert torch.equal(bnn.predictor()(x).probs, again.predictor()(x).probs)
