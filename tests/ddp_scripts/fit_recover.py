"""Worker of tests/test_stress_pretrained.py's DDP recovery test (``torchrun --nproc_per_node=2``).

Only rank 1 poisons one posterior tensor with NaN after optimiser step 2: its loss turns
NaN, the all-reduced loss with it, so *both* ranks recover (roll back to the same anchor,
halve the same learning rate) and go on; every rank writes its tensors and the
learning rates to OUT/rank<r>.pt.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

from bayesify import bayesify, fit
from bayesify.train import cleanup_distributed, setup_distributed


class PoisonOnRankOne:
    def __init__(self, bnn, rank: int) -> None:
        self.bnn, self.rank = bnn, rank

    def on_step_end(self, state, terms) -> None:
        if self.rank == 1 and state.global_step == 2:
            with torch.no_grad():
                next(p for p in self.bnn.posterior_parameters() if p.requires_grad).fill_(math.nan)


def main(out: Path) -> None:
    ctx = setup_distributed(None, torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 36, 3)).eval()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 6, 6, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    torch.manual_seed(1)
    bnn = bayesify(model, "ibnn")
    result = fit(bnn, DataLoader(TensorDataset(x, y), batch_size=8), epochs=2, seed=0,
                 progress=False, callbacks=[PoisonOnRankOne(bnn, ctx.rank)])
    torch.save({"posterior": {k: v.clone() for k, v in bnn.posterior_tensors().items()},
                "lr": result.history[-1]["lr"]}, out / f"rank{ctx.rank}.pt")
    cleanup_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
