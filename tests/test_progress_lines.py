"""Off a terminal the progress bars are a few log lines, not carriage-return frames (32.4).

A fit with validation search, ``calibrate`` and ``evaluate`` writes to a non-TTY
``sys.stderr``: the stream gets no ``\\r`` frame, and every phase says what it did in one
INFO line on ``bayesify.progress``. The same run with a stream that claims to be a
terminal draws tqdm frames (the check can fail).
"""

from __future__ import annotations

import io
import logging
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit
from bayesify import progress as progress_module


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _data(n: int = 48) -> tuple[DataLoader, DataLoader]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return (DataLoader(TensorDataset(x, y), batch_size=8),
            DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8))


def _run_phases() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    train, val = _data()
    bnn = bayesify(net, "ibnn", components=2)
    fit(bnn, train, val_loader=val, epochs=2, seed=0)  # progress=True: the default
    predictor = bnn.predictor()
    predictor.calibrate(val, force=True)  # after the search: calibrate only when forced
    predictor.evaluate(val)


def test_non_tty_stream_gets_log_lines_not_frames(monkeypatch, caplog):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    with caplog.at_level(logging.INFO, logger="bayesify"):
        _run_phases()
    assert "\r" not in stream.getvalue()
    lines = [r.getMessage() for r in caplog.records if r.name == "bayesify.progress"]
    assert any(line.startswith("epoch 1/2: 6/6 done in") and "loss=" in line for line in lines)
    assert any(line.startswith("epoch 2/2: 6/6 done in") for line in lines)
    assert any("validation search" in line and "done in" in line for line in lines)
    assert any(line.startswith("evaluate: 2/2 done in") for line in lines)
    # a few lines per phase, not one per batch
    assert len(lines) <= 12, lines


def test_a_terminal_still_gets_the_bar(monkeypatch, caplog):
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    with caplog.at_level(logging.INFO, logger="bayesify"):
        _run_phases()
    assert stream.getvalue().count("\r") > 5  # tqdm's frames: what the non-TTY run avoids
    assert not [r for r in caplog.records if r.name == "bayesify.progress"]


def test_long_phase_logs_every_interval(monkeypatch, caplog):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="bayesify.progress"):
        bar = progress_module.progress_bar(range(3), "phase")
        assert isinstance(bar, progress_module.PhaseLines) and len(bar) == 3
        assert list(bar) == [0, 1, 2]
        bar.close()  # a second close says nothing more
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in lines[:3]] == ["phase: 1/3", "phase: 2/3", "phase: 3/3"]
    assert lines[3].startswith("phase: 3/3 done in") and len(lines) == 4


@pytest.mark.parametrize("enabled", [False])
def test_disabled_bar_says_nothing(monkeypatch, caplog, enabled):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="bayesify.progress"):
        assert list(progress_module.progress_bar(range(2), "quiet", enabled=enabled)) == [0, 1]
    assert not caplog.records


def test_every_bar_of_the_library_goes_through_progress_bar():
    """A bar made with tqdm directly would write carriage-return frames into a log file
    (the demo's MAP training did): only bayesify.progress may import tqdm."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "src" / "bayesify"
    direct = [str(p.relative_to(package)) for p in package.rglob("*.py")
              if p.name != "progress.py" and "import tqdm" in p.read_text()
              or p.name != "progress.py" and "from tqdm" in p.read_text()]
    assert direct == []
