"""Ranks that do not run the same fit (tests/test_ddp.py, ``test_mismatched_ranks_*``).

Run by tests/ddp_scripts/fit_digits.py at the end of its torchrun launch (no process
start-up of its own), or standalone as two gloo processes with the torchrun variables
set. Each scenario gives rank 1 (or rank 0) something different and records,
per rank, the error ``fit`` raised and how long it took (ranks that agree train in
tests/test_ddp.py). Writes ``OUT/mismatch_rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import bayesify, fit
from bayesify.train.distributed import setup_distributed


def base(perturb: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    if perturb:
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0
    return model


def loader(n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4, shuffle=True)


def scenarios(rank: int, out: Path) -> dict[str, tuple[dict, dict]]:
    """name → (bayesify options, fit options) of this rank."""
    other = rank == 1
    plain = out / "plain-file"
    return {
        "dataset_length": ({}, {"train": loader(24 if other else 32)}),
        "lr": ({}, {"lr": 0.05 if other else 0.1}),
        "components": ({"components": 3 if other else 2}, {}),
        "epochs": ({}, {"epochs": 2 if other else 1}),
        "seed": ({}, {"seed": 2 if other else 1}),
        "base_weights": ({"perturb": other}, {}),
        "val_loader": ({}, {"val_loader": None if other else loader(8)}),
        "checkpoint_dir_is_a_file": ({}, {"checkpoint_dir": plain}),
    }


def run(rank: int, out: Path) -> None:
    """Every scenario on this rank (the process group is up); ``out/mismatch_rank{R}.json``."""
    if rank == 0:
        (out / "plain-file").write_text("not a directory")
    report: dict[str, dict] = {}
    for name, (wrap, options) in scenarios(rank, out).items():
        options = {"epochs": 1, "progress": False, "timeout_s": 30, **options}
        train = options.pop("train", loader())
        bnn = bayesify(base(wrap.pop("perturb", False)), "ibnn",
                       **{"components": 2, **wrap})
        start = time.monotonic()
        try:
            result = fit(bnn, train, **options)
            report[name] = {"error": None, "epochs": len(result.history)}
        except Exception as err:  # noqa: BLE001 - recorded for the test
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        report[name]["seconds"] = time.monotonic() - start
    (out / f"mismatch_rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":  # standalone: two processes with the torchrun variables set
    ctx = setup_distributed(None, torch.device("cpu"), timeout_s=30)
    run(ctx.rank, Path(sys.argv[1]))
    torch.distributed.destroy_process_group()
