"""Worker of tests/test_ddp.py, launched by ``torchrun --nproc_per_node=2``.

Every rank runs the same scenarios on digits (gloo, CPU) and writes its tensors
to OUT/<scenario>_rank<r>.pt; rank 0 also writes OUT/info.json.

- ``noisy``: iBNN with sampled noise and a trainable base, validation each epoch;
  every rank must end with identical tensors.
- ``det``: posterior means (``bnn.deterministic()``), to be compared with a
  one-process run at the same global batch.
- ``full`` / ``resumed``: 3 epochs uninterrupted vs. killed after epoch 1 and
  resumed from the checkpoint directory; ``vfull`` / ``vresumed`` the same with a
  ``val_loader`` (the never-worse rule decides at the end of both).
- last, ranks that disagree (tests/ddp_scripts/mismatched_ranks.py): OUT/mismatch_rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

torch.set_num_threads(1)

from bayesify import bayesify, fit
from bayesify.data.digits import load_digits_splits
from bayesify.data.models import DigitsCNN
from bayesify.train import evaluate_sharded, setup_distributed

PER_RANK_BATCH = 16
INIT_SEED = 100


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DigitsCNN(num_classes=5, width=8).eval()


def make_bnn(base: torch.nn.Module, **options):
    torch.manual_seed(INIT_SEED)  # identical posterior init on every rank and in the test
    return bayesify(base, "ibnn", components=2, samples=2, **options)


def killed_and_resumed(base: torch.nn.Module, train: DataLoader, directory: Path, rank: int,
                       **options):
    """A fit killed after its first epoch, then resumed from ``directory`` as a fresh
    process would (another RNG state, another posterior init): the model and its result."""
    try:
        fit(make_bnn(base), train, checkpoint_dir=directory, callbacks=[KillAfterEpoch(1)],
            **options)
        raise SystemExit("the kill callback did not fire")
    except Kill:
        pass
    torch.manual_seed(12345 + rank)
    bnn = bayesify(base, "ibnn", components=2, samples=2)
    return bnn, fit(bnn, train, checkpoint_dir=directory, resume=directory, **options)


def tensors(bnn) -> dict[str, torch.Tensor]:
    out = {f"posterior.{n}": p.detach().clone() for n, p in bnn.named_posterior_parameters()}
    out.update({f"base.{n}": p.detach().clone() for n, p in bnn.named_base_parameters()})
    # family state (e.g. the validation-tuned knob): identical on every rank too
    out.update({f"state.{n}": b.detach().clone() for n, b in bnn.state.named_buffers()})
    return out


class Kill(Exception):
    pass


class KillAfterEpoch:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_epoch_end(self, state, record) -> None:
        if state.epoch == self.epoch:
            raise Kill


DET_FIT = {"epochs": 2, "lr": 0.1, "base_lr": 0.01, "kl_anneal_epochs": 1, "seed": 5,
           "progress": False}


class Probe:
    """What each rank saw: its noise seed and its own (unreduced) first-batch NLL."""

    def __init__(self) -> None:
        self.data: dict = {}

    def on_step_end(self, state, terms) -> None:
        if state.ddp is not None and "ddp" not in self.data:
            logging = state.ddp._get_ddp_logging_data()
            self.data["ddp"] = {
                "ddp_bytes": int(logging.get("total_parameter_size_bytes", -1)),
                "ddp_tensors": int(logging.get("num_parameter_tensors", -1)),
                "trainable_bytes": sum(p.numel() * p.element_size()
                                       for p in state.bnn.parameters() if p.requires_grad),
                "trainable_tensors": sum(1 for p in state.bnn.parameters() if p.requires_grad),
                "frozen_tensors": sum(1 for p in state.bnn.parameters() if not p.requires_grad),
            }
            self.data["noise_seed"] = state.noise_generator.initial_seed()


def main(out: Path) -> None:
    ctx = setup_distributed(None, torch.device("cpu"))
    rank = ctx.rank
    splits = load_digits_splits(seed=0)
    train = DataLoader(splits.train, batch_size=PER_RANK_BATCH, shuffle=True)
    test = DataLoader(splits.test, batch_size=64)
    base = base_model()

    # noisy posterior, trainable base, validation every epoch
    bnn = make_bnn(base)
    x0, y0 = next(iter(train))
    with torch.no_grad():  # this rank's own loss on its own batch (differs per rank)
        local_nll = torch.nn.functional.cross_entropy(bnn(x0[rank::2]), y0[rank::2]).item()
    result = fit(bnn, train, epochs=2, lr=0.1, base_lr=0.01, kl_anneal_epochs=1, seed=3,
                 val_loader=test, progress=False)
    torch.save(tensors(bnn), out / f"noisy_rank{rank}.pt")
    info: dict = {"world_size": ctx.world_size, "history": result.history,
                  "local_first_nll": local_nll}
    info["test_metrics"] = evaluate_sharded(bnn, test, ctx, samples_per_component=2)

    # posterior means: comparable with one process at the same global batch
    bnn = make_bnn(base, learn_std=False)
    with bnn.deterministic():  # drop_last: no padded partial batch, so 2×16 ≡ 1×32 exactly
        fit(bnn, DataLoader(splits.train, batch_size=PER_RANK_BATCH, shuffle=True,
                            drop_last=True), **DET_FIT)
    torch.save(tensors(bnn), out / f"det_rank{rank}.pt")

    # uninterrupted vs killed after epoch 1 and resumed (frozen base)
    opts = {"epochs": 3, "lr": 0.1, "kl_anneal_epochs": 2, "lr_schedule": "linear:1:3:0.5",
            "seed": 7, "progress": False}
    probe = Probe()
    bnn = make_bnn(base)
    fit(bnn, train, checkpoint_dir=out / "ck_full", callbacks=[probe], **opts)
    torch.save(tensors(bnn), out / f"full_rank{rank}.pt")
    info.update(probe.data)
    bnn, resumed = killed_and_resumed(base, train, out / "ck_kill", rank, **opts)
    torch.save(tensors(bnn), out / f"resumed_rank{rank}.pt")
    info["resumed_epochs"] = [r["epoch"] for r in resumed.history]

    # the same with validation: the never-worse rule decides after the resume from what the
    # checkpoint carried (rank 0 wrote it), alike on every rank
    vopts = {**opts, "val_loader": test, "val_every": 1}
    bnn = make_bnn(base)
    info["vfull_kept"] = fit(bnn, train, **vopts).last.get("kept")
    torch.save(tensors(bnn), out / f"vfull_rank{rank}.pt")
    bnn, resumed = killed_and_resumed(base, train, out / "ck_vkill", rank, **vopts)
    info["vresumed_kept"] = resumed.last.get("kept")
    torch.save(tensors(bnn), out / f"vresumed_rank{rank}.pt")
    (out / f"info_rank{rank}.json").write_text(json.dumps(info, default=float))
    import mismatched_ranks  # next to this script (sys.path[0] when run as one)

    mismatched_ranks.run(rank, out)  # ranks that disagree: one error on every rank
    # every output is written; the refused mismatch fits can leave gloo work behind that
    # aborts rank 0 at teardown ("terminate called without an active exception", seen once
    # in a CI dry run after both mismatch_rank*.json were complete): leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
