"""Temperatures and calibration files are validated and tied to their posterior.

``calibrate`` refuses too few examples and warns when the temperature sits at a bound
of the search; ``calibration.json`` records the checksum of the posterior it was
fitted on, and the CLI refuses an invalid (T ≤ 0, NaN, unreadable) or stale one (left
from before a re-fit into the same folder) instead of applying it.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, ModelPredictor
from bayesify.cli import main
from bayesify.predict.calibration import MIN_CALIBRATION_EXAMPLES, read_calibration_file

FAST = ["--no-progress", "--option", "components=2", "--option", "predict_samples=1"]


def predictor() -> ModelPredictor:
    torch.manual_seed(0)
    return ModelPredictor(nn.Linear(4, 3))


def loader(n: int, *, wrong: float = 0.3) -> DataLoader:
    """``n`` examples labelled as the model predicts, a fraction ``wrong`` of them not."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    with torch.no_grad():
        labels = predictor().models[0](x).argmax(-1)
    flip = torch.arange(n) < round(wrong * n)
    return DataLoader(TensorDataset(x, torch.where(flip, (labels + 1) % 3, labels)),
                      batch_size=4)


@pytest.mark.parametrize("n", [1, 2, MIN_CALIBRATION_EXAMPLES - 1])
def test_too_few_examples_are_refused(n):
    p = predictor()
    with pytest.raises(BayesifyError, match=f"{n} labelled example"):
        p.calibrate(loader(n))
    assert p.temperature == 1.0


def test_a_temperature_at_a_search_bound_warns():
    p = predictor()
    with pytest.warns(UserWarning, match="bound of the search"):
        p.calibrate(loader(8, wrong=1.0))  # every example wrong: NLL falls as T grows


def test_enough_examples_calibrate_without_warning(recwarn):
    result = predictor().calibrate(loader(MIN_CALIBRATION_EXAMPLES + 40))
    assert 0.05 < result.temperature < 20
    assert not [w for w in recwarn if "bound" in str(w.message)]


@pytest.mark.parametrize(("option", "value"), [("rule", "median"), ("max_iter", 0),
                                               ("max_iter", True)])
def test_calibrate_options_are_checked(option, value):
    with pytest.raises(BayesifyError, match=option):
        predictor().calibrate(loader(8), **{option: value})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["fit", "--data", "digits", "--map-epochs", "2", "--epochs", "1",
                 "--out", str(out), *FAST]) == 0
    # fit's validation search chose the temperature: calibrate refuses to move it
    assert main(["calibrate", "--posterior", str(out), "--no-progress"]) != 0
    assert not (out / "calibration.json").exists()
    assert main(["calibrate", "--posterior", str(out), "--no-progress", "--force"]) == 0
    return out


@pytest.mark.parametrize("temperature", [-3.0, 0.0, "nan", "1.5", None])
def test_the_cli_refuses_an_invalid_calibration_file(run, capsys, temperature):
    path = run / "calibration.json"
    good = path.read_text()
    payload = json.loads(good)
    payload["temperature"] = float(temperature) if temperature == "nan" else temperature
    path.write_text(json.dumps(payload))
    try:
        assert main(["evaluate", "--posterior", str(run), "--no-progress", "--no-plots"]) != 0
        assert "calibration.json" in capsys.readouterr().err
    finally:
        path.write_text(good)
    assert read_calibration_file(path, run) > 0


def test_the_cli_refuses_a_stale_calibration_file_after_a_refit(run, tmp_path, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert main(["evaluate", "--posterior", str(copy), "--no-progress", "--no-plots"]) == 0
    assert main(["fit", "--data", "digits", "--map-epochs", "2", "--epochs", "1", "--seed", "7",
                 "--out", str(copy), *FAST]) == 0  # a re-fit into the same folder
    capsys.readouterr()
    assert main(["evaluate", "--posterior", str(copy), "--no-progress", "--no-plots"]) != 0
    assert "stale" in capsys.readouterr().err
    assert main(["calibrate", "--posterior", str(copy), "--no-progress", "--force"]) == 0
    assert main(["evaluate", "--posterior", str(copy), "--no-progress", "--no-plots"]) == 0
