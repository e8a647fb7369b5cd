"""Plots a practitioner would keep and scores that say "n/a" without signal (issue 24.6)."""

from __future__ import annotations

import re

import torch

from bayesify import ModelPredictor, bayesify, metrics, plots
from bayesify.demo import format_table
from tests.test_registry_state import loader, model


def test_reliability_diagram_shows_counts_and_never_draws_empty_bins():
    conf = torch.tensor([0.95] * 40 + [0.55, 0.56] + [0.25])  # bins: 14 (40), 8 (2), 3 (1)
    correct = torch.tensor([1.0] * 36 + [0.0] * 4 + [1.0, 0.0] + [0.0])
    fig = plots.reliability_figure({"model": (conf, correct)}, n_bins=15)
    diagram, histogram = fig.axes
    bars = [b for b in diagram.patches if b.get_width() > 0]
    assert len(bars) == 3  # one bar per non-empty bin: no line across empty bins
    assert sorted(t.get_text() for t in diagram.texts) == ["1", "2", "40"]
    sparse = [b for b in bars if b.get_hatch()]
    assert len(sparse) == 2 and all(b.get_alpha() < 0.5 for b in sparse)  # < 10 examples
    heights = sorted(round(b.get_height(), 3) for b in bars)
    assert heights == [0.0, 0.5, 0.9]
    assert histogram.get_yscale() == "log"
    assert sorted(b.get_height() for b in histogram.patches if b.get_height() > 0) == [1, 2, 40]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_uncertainty_histograms_have_mi_and_say_when_there_is_no_signal(tmp_path):
    ones = torch.ones(20)
    groups = {
        "map": {"in": {"entropy": torch.rand(20), "epistemic": ones * 1e-8},
                "ood": {"entropy": torch.rand(20) + 0.5, "epistemic": ones * 3e-8}},
        "bnn": {"in": {"entropy": torch.rand(20), "epistemic": torch.rand(20) * 0.1},
                "ood": {"entropy": torch.rand(20) + 0.5, "epistemic": torch.rand(20) * 0.3 + 0.1}},
    }
    fig = plots.uncertainty_figure(groups, num_classes=5)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 4 and "map: MI — OOD AUROC n/a" in titles
    assert any(re.fullmatch(r"bnn: MI — OOD AUROC [01]\.\d{3}", t) for t in titles)
    map_mi = fig.axes[1]
    assert "no epistemic signal" in map_mi.texts[0].get_text() and not map_mi.patches
    assert plots.save_uncertainty_histograms(groups, tmp_path / "u.png", 5).stat().st_size > 5000


def test_single_network_mi_auroc_is_na_everywhere():
    data, ood = loader(n=24, seed=0), loader(n=24, seed=5)
    single = ModelPredictor(model()).evaluate(data, ood)
    assert single["ood_auroc_mi"] is None and isinstance(single["ood_auroc_entropy"], float)
    # init_mean_std is divided by sqrt(wrapped layers): 0.9 here is 0.52 per layer
    posterior = bayesify(model(), "ibnn", init_mean_std=0.9).predictor().evaluate(data, ood)
    assert isinstance(posterior["ood_auroc_mi"], float)
    table = format_table({"map": single, "ibnn": posterior})
    map_row = next(line for line in table.splitlines() if line.strip().startswith("map"))
    assert "n/a" in map_row and "n/a" not in table.splitlines()[2]
    assert metrics.ood_auroc(torch.zeros(5), torch.full((5,), 1e-9)) is None
    assert metrics.ood_auroc(torch.zeros(5), torch.ones(5)) == 1.0
