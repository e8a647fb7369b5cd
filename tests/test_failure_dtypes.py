"""Networks and labels in other dtypes than float32 / int64 (thirty-first stop).

Found by fitting every family on small variations of one network: int32 labels crashed
the training step of eleven families with torch's "expected target dtype to be Long"; a
float64 network failed in rank1 and batchensemble (inputs cast to the float32 rank-one
factors' dtype, not the network's) and in mnf (its float64 flow fed float32 noise in the
KL); a bfloat16 network failed in seven families with torch's dtype errors. Now: integer
labels of any width are class indices, a float64 network fits with every family, and a
half-precision network is refused by ``fit`` before anything changes, with the remedy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit, list_methods
from bayesify.core.batch import model_dtype


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3)).eval()


def _data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 5, 5, generator=g)
    return x, (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()


def _loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=16)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("method", ["ibnn", "swag"])
def test_narrow_integer_labels_fit_exactly_as_int64(method, dtype) -> None:
    """The same fit with labels of another integer width: the same posterior, exactly."""
    x, y = _data()
    fitted = []
    for labels in (y, y.to(dtype)):
        bnn = bayesify(_net(), method)
        fit(bnn, _loader(x, labels), val_loader=_loader(x, labels), epochs=1, progress=False,
            seed=0)
        fitted.append(bnn.predictor(seed=0)(x[:8]).probs)
    torch.testing.assert_close(fitted[0], fitted[1], rtol=0, atol=0)


@pytest.mark.parametrize("method", list_methods())
def test_every_family_fits_a_float64_network(method) -> None:
    """A float64 network and float64 inputs: one epoch with validation, finite predictions;
    float32 inputs are cast to the network's dtype (the same probabilities, exactly)."""
    x, y = _data()
    bnn = bayesify(_net().double(), method)
    fit(bnn, _loader(x.double(), y), val_loader=_loader(x.double(), y), epochs=1, progress=False)
    probs = bnn.predictor(seed=0)(x[:8].double()).probs
    assert torch.isfinite(probs).all() and probs.shape == (8, 3)
    torch.testing.assert_close(bnn.predictor(seed=0)(x[:8]).probs, probs, rtol=0, atol=0)


def test_the_network_dtype_is_the_user_weights_not_a_wrapper_factor() -> None:
    """rank1's float32 factors come first in each wrapper of a float64 network: the inputs
    are cast to float64, the weights' dtype."""
    bnn = bayesify(_net().double(), "rank1")
    first = next(p for p in bnn.model.parameters() if p.is_floating_point())
    assert first.dtype == torch.float32  # the premise: a posterior factor comes first
    assert model_dtype(bnn.model) == torch.float64
    assert model_dtype(nn.Linear(2, 2)) == torch.float32 and model_dtype(object()) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_network_is_refused_before_anything_changes(dtype) -> None:
    """fit refuses, naming the dtype and bnn.float(); the posterior is untouched, and the
    remedy fits."""
    x, y = _data()
    bnn = bayesify(_net().to(dtype), "ibnn")
    before = {k: v.clone() for k, v in bnn.state_dict().items()}
    with pytest.raises(BayesifyError, match=rf"{str(dtype)[6:]} parameters.*bnn\.float\(\)"):
        fit(bnn, _loader(x.to(dtype), y), epochs=1, progress=False)
    for k, v in bnn.state_dict().items():
        assert torch.equal(v, before[k]), k
    fit(bnn.float(), _loader(x.to(dtype), y), epochs=1, progress=False)
    assert torch.isfinite(bnn.predictor()(x[:4]).probs).all()


def test_the_heads_feature_posterior_of_a_half_precision_model_is_computed_wide() -> None:
    """A posterior moved with ``bnn.to(torch.bfloat16)`` carries the feature layers' sums in
    bf16: their eigendecomposition (no half kernel) runs in float64 on those values."""
    from bayesify.kit import feature_layers as trunk

    g = torch.Generator().manual_seed(0)
    psi = torch.randn(40, 5, generator=g, dtype=torch.float64)
    sums = (psi.sum(0), psi.T @ psi, torch.tensor(3.0, dtype=torch.float64),
            torch.tensor(40.0, dtype=torch.float64))
    half = tuple(t.to(torch.bfloat16) for t in sums)
    wide = trunk.TrunkPosterior(tuple(trunk.wide(t) for t in half), [2, 3], 10.0)
    exact = trunk.TrunkPosterior(tuple(t.double() for t in half), [2, 3], 10.0)
    torch.testing.assert_close(wide.variance(psi[:4], 1.0), exact.variance(psi[:4], 1.0))
    assert trunk.wide(sums[0]) is sums[0]  # float64 and float32 stay as they are


@pytest.mark.parametrize("method", list_methods())
def test_every_family_predicts_in_bfloat16_after_a_float32_fit(method) -> None:
    """``bnn.to(torch.bfloat16)`` after ``fit`` (half the memory to serve): finite
    probabilities close to the float32 predictive (before, hypernet and mnf failed in their
    member forward: float32 noise into a bf16 generator or flow)."""
    x, y = _data()
    bnn = bayesify(_net(), method)
    fit(bnn, _loader(x, y), val_loader=_loader(x, y), epochs=1, progress=False, seed=0)
    full = bnn.predictor(seed=0)(x[:8]).probs
    bnn.to(torch.bfloat16)
    half = bnn.predictor(seed=0)(x[:8].to(torch.bfloat16)).probs
    assert torch.isfinite(half).all() and half.shape == (8, 3)
    assert float((half.float() - full.float()).abs().max()) < 0.01  # measured ≤ 0.002
