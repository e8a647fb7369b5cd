"""A predictor is safe to serve: threads, non-finite and huge inputs, temperatures.

Every family is fitted briefly once; then 4 threads call the same predictor (and a
second predictor of the same model) on different inputs and must get exactly the
serial result. NaN/inf inputs and finite inputs whose predictive overflows are
clear errors unless ``nonfinite="propagate"``; temperatures must be finite and > 0.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, ModelPredictor, bayesify, fit, list_methods

FAMILY_OPTIONS = {"swag": {"max_rank": 3, "snapshot_every_steps": 1, "scale_method": "fixed"},
                  "hypernet": {"targets": "last_layer"}}


def base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).eval()


def data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()


@pytest.fixture(scope="module")
def fitted():
    x, y = data()
    out = {}
    for method in list_methods():
        torch.manual_seed(2)
        bnn = bayesify(base(), method, **FAMILY_OPTIONS.get(method, {}))
        loader = DataLoader(TensorDataset(x, y), batch_size=16)
        fit(bnn, loader, progress=False, **({"epochs": 2} if bnn.method.step().optimizes else {}))
        out[method] = bnn
    return out


def probs(predictor, inputs):
    return [predictor(x).probs for x in inputs]


@pytest.mark.parametrize("method", sorted(list_methods()))
def test_four_threads_equal_serial(fitted, method):
    bnn = fitted[method]
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(int(b), 6, generator=g) for b in torch.randint(1, 9, (24,), generator=g)]
    predictor, other = bnn.predictor(), bnn.predictor(samples_per_component=2)
    serial = probs(predictor, inputs)
    serial_other = probs(other, inputs)
    results: dict[int, list] = {}
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def worker(index: int) -> None:
        try:
            barrier.wait()
            use = predictor if index % 2 == 0 else other
            results[index] = [(i, use(inputs[i]).probs) for i in range(index, len(inputs), 2)]
        except Exception as err:  # noqa: BLE001 - collected
            errors.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for index, rows in results.items():
        reference = serial if index % 2 == 0 else serial_other
        for i, got in rows:
            assert torch.equal(got, reference[i]), (method, index, i)


@pytest.mark.parametrize("method", sorted(list_methods()))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_inputs_are_a_clear_error(fitted, method, value):
    x = torch.randn(4, 6)
    x[2, 3] = value
    predictor = fitted[method].predictor()
    with pytest.raises(BayesifyError, match=r"predictor: .*NaN.* in rows \[2\]"):
        predictor(x)
    with pytest.raises(BayesifyError, match="NaN"):
        predictor.evaluate(DataLoader(TensorDataset(x, torch.zeros(4, dtype=torch.long)),
                                      batch_size=4))
    passed = fitted[method].predictor(nonfinite="propagate")(x).probs  # the documented opt-out
    assert not bool(torch.isfinite(passed[2]).all())


@pytest.mark.parametrize("method", sorted(list_methods()))
@pytest.mark.parametrize("scale", [1e30, 1e38])
def test_huge_finite_inputs_never_give_silent_nan(fitted, method, scale):
    x = torch.randn(4, 6)
    x[1] *= scale
    try:
        probs_ = fitted[method].predictor()(x).probs
    except BayesifyError as err:
        assert "overflow" in str(err) and "largest |input|" in str(err)
    else:
        assert bool(torch.isfinite(probs_).all())
        assert torch.allclose(probs_.sum(-1), torch.ones(4))


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf"), -0.5])
def test_invalid_temperatures_are_refused(fitted, value):
    bnn = fitted["ibnn"]
    predictor = bnn.predictor()
    before = predictor.temperature
    with pytest.raises(BayesifyError, match="finite number > 0"):
        predictor.temperature = value
    assert predictor.temperature == before  # nothing changed
    with pytest.raises(BayesifyError, match="finite number > 0"):
        bnn.predictor(temperature=value)
    with pytest.raises(BayesifyError, match="finite number > 0"):
        ModelPredictor(base(), temperature=value)
    with pytest.raises(TypeError, match="finite number > 0"):
        predictor.temperature = True


def test_a_bad_temperature_stored_with_a_posterior_is_refused_when_used(fitted):
    bnn = fitted["ibnn"]
    predictor = bnn.predictor()
    bnn.state.set("temperature", -3.0)
    try:
        with pytest.raises(BayesifyError, match="stored with the posterior"):
            predictor(torch.randn(2, 6))
    finally:
        bnn.state.set("temperature", 1.0)


def test_a_softmax_model_is_refused(fitted):
    model = nn.Sequential(base(), nn.Softmax(-1))
    with pytest.raises(BayesifyError, match="outputs probabilities"):
        ModelPredictor(model)(torch.randn(4, 6))
    bnn = bayesify(model, "ibnn")
    with pytest.raises(BayesifyError, match="outputs probabilities"):
        bnn.predictor()(torch.randn(4, 6))
    log_model = nn.Sequential(base(), nn.LogSoftmax(-1))  # log-probabilities are logits
    assert ModelPredictor(log_model)(torch.randn(4, 6)).probs.shape == (4, 3)


@pytest.mark.parametrize("method", ["ibnn", "laplace", "swag"])
def test_threads_calling_the_model_s_predictive_directly_equal_serial(fitted, method):
    bnn = fitted[method]
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(5, 6, generator=g) for _ in range(12)]
    bnn.eval()
    serial = [bnn.predictive(x).probs for x in inputs]
    got: dict[int, torch.Tensor] = {}

    def worker(start: int) -> None:
        for i in range(start, len(inputs), 4):
            got[i] = bnn.predictive(inputs[i]).probs

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(got[i], serial[i]) for i in range(len(inputs)))
