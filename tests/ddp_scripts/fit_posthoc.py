"""Worker of tests/test_one_loop.py, launched by ``torchrun --nproc_per_node=2`` (and
called in-process with world size 1 by the test): the post-hoc families in the one
loop on digits, with a fixed data order.

- ``laplace``: last-layer KFAC, marginal-likelihood τ: curvature, loss and counts
  must be all-reduced, never counted twice;
- ``laplace-features``: the feature curvature with the feature layers' sums (the
  BatchNorm's pooled outputs), all-reduced like the curvature;
- ``swag``: SGD snapshots from the pretrained CNN (with BatchNorm), seeded order;
- ``ensemble-heads``: the ensemble with ``val_loader``: its search, then member-wise
  Laplace heads with the feature layers (the BatchNorm's pooled outputs in every member's
  forward), their sums all-reduced and their τ × T searched on the sharded split.

Writes OUT/<family>_rank<r>.pt: posterior tensors + member logits on a test batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

from bayesify import bayesify, fit
from bayesify.train import cleanup_distributed, setup_distributed

GLOBAL_BATCH = 32


def data(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
    return x, y


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4),
    ).eval()


def run(family: str, world: int) -> dict[str, torch.Tensor]:
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // world, shuffle=False)
    if family == "laplace":
        bnn = bayesify(base_model(), "laplace", targets="last_layer", prior_method="marglik")
        fit(bnn, loader, progress=False)
    elif family == "laplace-features":  # the feature curvature and its feature layers' sums
        bnn = bayesify(base_model(), "laplace", curvature="features", prior_method="fixed",
                       prior_precision=0.3)
        fit(bnn, loader, progress=False)
    elif family == "ensemble-heads":  # the heads: fitted after the family's own search
        xv, yv = data(64, seed=5)
        torch.manual_seed(11)  # identical members on every rank
        bnn = bayesify(base_model(), "ensemble")
        fit(bnn, loader, val_loader=DataLoader(TensorDataset(xv, yv), batch_size=16),
            epochs=1, seed=3, progress=False)
    else:
        bnn = bayesify(base_model(), "swag", snapshot_every_steps=1, predict_samples=3,
                       lr=0.05, scale_method="fixed")
        fit(bnn, loader, epochs=2, seed=3, progress=False)
    out = {k: v.detach().clone() for k, v in bnn.posterior_tensors().items()}
    prediction = bnn.predictor().predict(data(8, seed=1)[0])
    out["_member_logits"] = prediction.member_logits
    out["_probs"] = prediction.probs
    if family == "ensemble-heads":
        out["_temperature"] = torch.tensor(float(bnn.state.temperature))
    return out


#: the cases of :func:`run`
POSTHOC = ("laplace", "laplace-features", "swag", "ensemble-heads")

#: families whose fit draws no noise: 2 ranks must equal 1 process, not only each other
NOISE_FREE = ("laplace", "swag", "batchensemble", "ensemble")


def run_default(family: str, world: int) -> dict[str, torch.Tensor]:
    """Every family with its defaults (2 epochs of 3 global batches, seeded order)."""
    from bayesify import list_methods  # noqa: F401 - the registry is the test's parameter

    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // world, shuffle=True)
    torch.manual_seed(11)  # identical posterior initialisation on every rank
    bnn = bayesify(base_model(), family)
    kw = {} if not bnn.method.step().optimizes else {"epochs": 2, "seed": 3, "n_train": 5000}
    fit(bnn, loader, progress=False, **kw)
    return {k: v.detach().clone() for k, v in bnn.posterior_tensors().items()}


def main(out_dir: str) -> None:
    from bayesify import list_methods

    ctx = setup_distributed(None, torch.device("cpu"))
    for family in POSTHOC:
        torch.save(run(family, ctx.world_size), Path(out_dir) / f"{family}_rank{ctx.rank}.pt")
    for family in list_methods():
        torch.save(run_default(family, ctx.world_size),
                   Path(out_dir) / f"default_{family}_rank{ctx.rank}.pt")
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
