"""Bad data at the entry points: clear errors instead of bare torch ones.

``bayesify.core.checks`` (labels, finite inputs/logits) and ``calibrate`` on an
empty loader, NaN logits, float or out-of-range labels.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, ModelPredictor
from bayesify.core.checks import check_finite_inputs, check_finite_logits, check_labels
from bayesify.predict.calibration import fit_temperature


def test_check_labels_refuses_float_and_out_of_range_labels():
    assert check_labels(torch.tensor([0, 2, 1], dtype=torch.int32), 3, where="fit").dtype == torch.long
    with pytest.raises(BayesifyError, match="fit: labels must be integer class indices.*float32"):
        check_labels(torch.tensor([0.0, 1.0]), 3, where="fit")
    with pytest.raises(BayesifyError, match=r"predictor: labels must be class indices in \[0, 2\]"
                       r".*found 2 outside, e.g. \[-1, 3\]"):
        check_labels(torch.tensor([0, 3, -1, 1]), 3, where="predictor")
    with pytest.raises(BayesifyError, match=r"shape \[N\]"):
        check_labels(torch.zeros(2, 3, dtype=torch.long), 3, where="fit")
    with pytest.raises(BayesifyError, match="integer class indices"):
        check_labels(torch.tensor([True, False]), 3, where="fit")
    with pytest.raises(TypeError, match="tensor of class indices"):
        check_labels([0, 1], 3, where="fit")
    assert check_labels(torch.tensor([5]), None, where="fit").tolist() == [5]  # only >= 0 known


def test_check_finite_inputs_names_the_entry_and_rows():
    x = torch.zeros(4, 3)
    check_finite_inputs({"input_ids": torch.ones(2, 5, dtype=torch.long), "pixels": x}, where="fit")
    x[2, 1] = float("nan")
    x[3, 0] = float("inf")
    with pytest.raises(BayesifyError, match=r"fit: inputs\['pixels'\] holds 1 NaN and 1 infinite "
                       r"values in rows \[2, 3\]"):
        check_finite_inputs({"pixels": x}, where="fit")
    with pytest.raises(BayesifyError, match=r"laplace: inputs\[0\] holds"):
        check_finite_inputs((x, torch.zeros(4)), where="laplace")
    with pytest.raises(BayesifyError, match="non-finite logits for 1 example"):
        check_finite_logits(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), where="predictor")


class NaNModel(nn.Module):
    """Logits NaN for inputs whose first feature is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x[:, :3].clone()
        logits[x[:, 0] < 0] = float("nan")
        return logits


def _loader(x, y, batch_size=4):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def test_calibrate_refuses_empty_loaders_nan_logits_and_bad_labels():
    predictor = ModelPredictor(NaNModel())
    x = torch.rand(8, 4)
    y = torch.randint(0, 3, (8,))
    with pytest.raises(BayesifyError, match="calibrate: the validation loader is empty"):
        predictor.calibrate(_loader(x[:0], y[:0]))
    with pytest.raises(BayesifyError, match="produced no batches|no examples"):
        predictor.calibrate(iter([]))
    with pytest.raises(BayesifyError, match="integer class indices"):
        predictor.calibrate(_loader(x, y.float()))
    with pytest.raises(BayesifyError, match=r"class indices in \[0, 2\]"):
        predictor.calibrate(_loader(x, y + 3))
    bad = x.clone()
    bad[5, 0] = -1.0
    with pytest.raises(BayesifyError, match="calibrate: the model produced non-finite logits"):
        predictor.calibrate(_loader(bad, y))
    assert predictor.temperature == 1.0  # nothing was set by the refused calls
    result = predictor.calibrate(_loader(x, y))  # the same loader, clean: works
    assert result.n == 8 and result.nll_after <= result.nll_before + 1e-9


def test_fit_temperature_checks_its_inputs():
    logits = torch.randn(2, 5, 3)
    labels = torch.randint(0, 3, (5,))
    assert 0.01 <= fit_temperature(logits, labels) <= 100
    with pytest.raises(BayesifyError, match="N > 0"):
        fit_temperature(logits[:, :0], labels[:0])
    nan = logits.clone()
    nan[0, 1, 2] = float("nan")
    with pytest.raises(BayesifyError, match="non-finite logits"):
        fit_temperature(nan, labels)
