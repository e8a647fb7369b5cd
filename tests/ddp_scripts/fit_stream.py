"""Worker of tests/test_streaming_loaders.py's DDP test (``torchrun --nproc_per_node=2``).

Each rank streams its own shard (an ``IterableDataset``, as WebDataset's ``split_by_node``
gives), of unequal length: rank 0 six batches, rank 1 four. ``fit`` (iBNN, two epochs,
``n_train``) must end on both ranks with the same posterior, each epoch four steps long;
every rank writes its tensors and step counts to OUT/rank<r>.pt. A collective timeout of
60 s turns the hang this guards against into a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

torch.set_num_threads(1)

from bayesify import bayesify, fit
from bayesify.train import cleanup_distributed, setup_distributed


class Shard(IterableDataset):
    def __init__(self, rank: int) -> None:
        gen = torch.Generator().manual_seed(rank)
        n = 48 if rank == 0 else 32
        self.x, self.y = torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)

    def __iter__(self):
        return iter(zip(self.x, self.y, strict=True))


def main(out: Path) -> None:
    ctx = setup_distributed(None, torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3)).eval()
    torch.manual_seed(1)
    bnn = bayesify(model, "ibnn")
    result = fit(bnn, DataLoader(Shard(ctx.rank), batch_size=8), n_train=80, epochs=2, seed=0,
                 progress=False, timeout_s=60)
    torch.save({"posterior": {k: v.clone() for k, v in bnn.posterior_tensors().items()},
                "steps": [r["steps"] for r in result.history]}, out / f"rank{ctx.rank}.pt")
    cleanup_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
