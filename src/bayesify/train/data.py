"""Training data order as a function of ``(seed, epoch)``, sharded over ranks.

:class:`GlobalBatchSampler` is a :class:`DistributedSampler` whose shards are
*contiguous slices of one global batch*: epoch ``e`` shuffles the dataset with
``seed + e`` (the same permutation as ``DistributedSampler``), global batch ``b``
is ``perm[b·G : (b+1)·G]`` with ``G = batch_size × world_size``, and rank ``r``
takes the ``r``-th slice of it. So a data-parallel run sees exactly the global
batches that a single process with batch ``G`` sees, and families whose row
layout depends on the position in the batch (iBNN deals rows to components
round-robin) get the same example → component pairs as long as K divides the
per-rank batch. The order does not depend on the world size, which makes a
checkpoint resumable with a different number of processes at the same global
batch, and it can start at any batch (mid-epoch resume) without reading the
skipped data.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from bayesify.core.batch import Batch, BatchFn, iter_batches, limited_batches, split_batch
from bayesify.errors import BayesifyError
from bayesify.train.distributed import DistContext, all_reduce_sum

#: a loader's end, in :meth:`TrainData._in_step`
_END = object()


class GlobalBatchSampler(DistributedSampler):
    """Per-rank indices of contiguous slices of seeded global batches.

    ``batch_size``: per-rank batch B_r; global batch G = B_r·world. With
    ``drop_last=False`` the last partial global batch is padded (by wrapping
    around, as ``DistributedSampler`` does) to a multiple of ``world`` and split
    evenly, so every rank runs the same number of steps.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.batch_size = int(batch_size)
        self.start_batch = 0
        n = len(dataset)  # type: ignore[arg-type]
        self.dataset_size = n
        global_batch = self.batch_size * num_replicas
        self.full_batches, remainder = divmod(n, global_batch)
        self.last_per_rank = 0 if (drop_last or remainder == 0) else math.ceil(remainder / num_replicas)
        self.batches = self.full_batches + (1 if self.last_per_rank else 0)
        self.num_samples = self.full_batches * self.batch_size + self.last_per_rank
        self.total_size = self.num_samples * num_replicas

    def set_start_batch(self, batch: int) -> None:
        """Skip the first ``batch`` batches of the epoch (mid-epoch resume)."""
        self.start_batch = max(0, min(int(batch), self.batches))

    def global_order(self) -> list[int]:
        """The epoch's permutation of the dataset (identical on every rank)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_size, generator=g).tolist()
        return list(range(self.dataset_size))

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        if len(order) < self.total_size:
            reps = math.ceil(self.total_size / max(len(order), 1))
            order = (order * (reps + 1))[: self.total_size]
        g = self.batch_size * self.num_replicas
        out: list[int] = []
        for b in range(self.start_batch, self.batches):
            size = self.batch_size if b < self.full_batches else self.last_per_rank
            begin = b * g + self.rank * size
            out.extend(order[begin:begin + size])
        return iter(out)

    def __len__(self) -> int:
        skipped = min(self.start_batch, self.full_batches) * self.batch_size
        if self.start_batch > self.full_batches:
            skipped += self.last_per_rank
        return self.num_samples - skipped


class ShardSampler(Sampler[int]):
    """Contiguous, unpadded shard ``rank`` of ``range(n)`` (evaluation: every example once)."""

    def __init__(self, n: int, *, rank: int, world_size: int) -> None:
        per = math.ceil(n / world_size)
        self.indices = list(range(min(rank * per, n), min((rank + 1) * per, n)))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def rebuildable(loader: Iterable) -> bool:
    """A plain ``DataLoader`` over a map-style dataset with a standard sampler."""
    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and loader.batch_size is not None
        and isinstance(loader.sampler, (RandomSampler, SequentialSampler))
    )


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    return kwargs


class TrainData:
    """The training batches of every epoch.

    When ``seeded`` (distributed, checkpointing or an explicit seed), the user's
    loader is rebuilt around a :class:`GlobalBatchSampler` (same dataset,
    per-rank ``batch_size``, workers, ``collate_fn``) and the workers' base seed is
    a function of ``(seed, epoch, rank)``; otherwise the loader is used as given.
    ``exact``: a statistics pass instead — this rank's contiguous, unpadded shard
    (:func:`shard_loader`, every example exactly once over the ranks), in order.
    """

    def __init__(self, loader: Iterable, *, ctx: DistContext, seed: int, seeded: bool,
                 exact: bool = False) -> None:
        self.original = loader
        self.ctx = ctx
        self.seed = int(seed)
        self.sampler: GlobalBatchSampler | None = None
        self.loader: Iterable = loader
        self.exact = exact
        self._skip = 0
        if exact:
            self.loader = shard_loader(loader, ctx)
        elif seeded and rebuildable(loader):
            assert isinstance(loader, DataLoader)
            self.sampler = GlobalBatchSampler(
                loader.dataset, batch_size=loader.batch_size, num_replicas=ctx.world_size,
                rank=ctx.rank, shuffle=isinstance(loader.sampler, RandomSampler),
                seed=self.seed, drop_last=loader.drop_last,
            )
            self._generator = torch.Generator()
            self.loader = DataLoader(loader.dataset, batch_size=loader.batch_size,
                                     sampler=self.sampler, drop_last=False,
                                     generator=self._generator, **_loader_kwargs(loader))
        elif ctx.distributed:
            warnings.warn(
                "fit under torchrun got a loader it cannot re-shard (not a DataLoader over a "
                "map-style dataset with a Random/Sequential sampler); assuming every rank's "
                "loader already yields its own shard; an epoch ends on every rank when the "
                "first rank's loader ends",
                stacklevel=3,
            )
        elif seeded:
            warnings.warn(
                "the training loader cannot be rebuilt with a seeded sampler; the data order "
                "after a resume follows the loader, not (seed, epoch)", stacklevel=3,
            )

    @property
    def rebuilt(self) -> bool:
        return self.sampler is not None

    @property
    def dataset_size(self) -> int | None:
        dataset = getattr(self.original, "dataset", None)
        try:
            return len(dataset) if dataset is not None else None  # type: ignore[arg-type]
        except TypeError:
            return None

    @property
    def batches_per_epoch(self) -> int:
        """Per-rank batches of a full epoch (0 when unknown)."""
        if self.sampler is not None:
            return self.sampler.batches
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            return 0

    @property
    def global_batch_size(self) -> int | None:
        size = getattr(self.original, "batch_size", None)
        return None if size is None else int(size) * self.ctx.world_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Order of epoch ``epoch``, starting at batch ``start_batch``."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            self.sampler.set_start_batch(start_batch)
            # worker base seeds: a function of (seed, epoch, rank)
            self._generator.manual_seed(
                (self.seed * 1_000_003 + epoch * 7_919 + self.ctx.rank * 104_729) % (2**63 - 1)
            )
            self._skip = 0
        else:
            sampler = getattr(self.original, "sampler", None)
            if hasattr(sampler, "set_epoch") and not self.exact:
                sampler.set_epoch(epoch)
            self._skip = start_batch

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        for _ in range(self._skip):  # no seeded sampler: skip by reading
            next(it, None)
        if self.ctx.distributed and self.sampler is None and not self.exact:
            return self._in_step(it)
        return it

    def _in_step(self, it: Iterator[Any]) -> Iterator[Any]:
        """The batches of a loader every rank shards itself (a stream: WebDataset's
        ``split_by_node``, a Hugging Face streaming split), in step over the ranks: before
        each batch the ranks agree that every one of them has one (a summed flag), and the
        epoch ends on every rank when the first rank's loader does. Without it, shards of
        unequal length left the longer ranks waiting in their next gradient all-reduce for a
        rank that had finished its epoch, until the collective timed out."""
        taken = 0
        while True:
            batch = next(it, _END)
            have = torch.tensor([0.0 if batch is _END else 1.0], dtype=torch.float64)
            ranks = int(all_reduce_sum(have, self.ctx).item())
            if ranks < self.ctx.world_size:
                if ranks and self.ctx.is_main:
                    warnings.warn(
                        f"the ranks' training loaders ended at different lengths: the epoch "
                        f"stopped on every rank after {taken} batch(es), when the first rank's "
                        f"loader ended; {ranks} of {self.ctx.world_size} ranks had batches "
                        "left that this epoch did not use. Give every rank the same number of "
                        "batches (e.g. WebDataset's .with_epoch(n), or equal shards)",
                        stacklevel=2)
                return
            taken += 1
            yield batch


def shard_loader(loader: Iterable, ctx: DistContext) -> Iterable:
    """This rank's shard of an evaluation ``DataLoader`` (the loader itself otherwise)."""
    if not ctx.distributed or not isinstance(loader, DataLoader) or loader.batch_size is None:
        return loader
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return loader
    sampler = ShardSampler(n, rank=ctx.rank, world_size=ctx.world_size)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                      **_loader_kwargs(loader))


# -- the one place in bayesify.train that iterates data ----------------------------------
def epoch_batches(data: TrainData, *, device: torch.device, batch_fn: BatchFn | None,
                  channels_last: bool = False) -> Iterator[Batch]:
    """The current epoch's batches of this rank (``data.set_epoch`` first), on ``device``."""
    return iter_batches(data, device=device, batch_fn=batch_fn, channels_last=channels_last)


def shard_batches(loader: Iterable, ctx: DistContext, *, device: torch.device,
                  batch_fn: BatchFn | None, fraction: float | None = None) -> Iterator[Batch]:
    """This rank's contiguous, unpadded shard of ``loader`` (every example once over the
    ranks), one batch at a time on ``device``; with ``fraction`` only the inputs of the
    first ``ceil(fraction · batches)`` batches."""
    shard = shard_loader(loader, ctx)
    if fraction is None:
        return iter_batches(shard, device=device, batch_fn=batch_fn)
    return limited_batches(shard, fraction=fraction, device=device, batch_fn=batch_fn)


def whole_batches(loader: Iterable, *, device: torch.device,
                  batch_fn: BatchFn | None) -> Iterator[Batch]:
    """Every batch of ``loader`` as one process streams it, on any rank (the search's shift
    signal is calibrated on it by the main process: the same on any number of ranks)."""
    return iter_batches(loader, device=device, batch_fn=batch_fn)


def training_set_size(loader: Iterable, *, batch_fn: BatchFn | None = None) -> int:
    """N_train: ``len(loader.dataset)``; a loader without a ``dataset`` (a list of batches, a
    generator) is refused with what N_train is for and how to pass it — after the checks
    every loader gets first (readable batches with labels), for a list or tuple of batches."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        try:
            return len(dataset)
        except TypeError:  # a stream (IterableDataset: WebDataset, HF streaming) has no length
            raise BayesifyError(
                "fit needs N_train, the number of training examples, to weigh the posterior's "
                "KL term per example (loss = NLL + β·KL / N_train) and to size its default "
                f"budget, but the training loader's {type(dataset).__name__} has no length "
                "(a streaming dataset): pass fit(..., n_train=N)") from None
    count = ""
    if isinstance(loader, (list, tuple)):  # re-iterable: the basic checks first
        if not loader:
            raise BayesifyError("fit: the training loader holds no batches")
        batches = [split_batch(b, batch_fn) for b in loader]
        for batch in batches:
            batch.require_labels("fit")
        total = sum(b.size for b in batches)
        count = f" (this {type(loader).__name__} of batches holds {total} examples: n_train={total})"
    raise BayesifyError(
        "fit needs N_train, the number of training examples, to weigh the posterior's KL term "
        "per example (loss = NLL + β·KL / N_train; a wrong N_train over- or under-regularises "
        f"the posterior), but a {type(loader).__name__} has no .dataset to count: pass "
        f"fit(..., n_train=N){count}, or give fit a torch DataLoader"
    )


def first_rows(batches: Iterable[Batch], quota: int) -> list[tuple[Any, torch.Tensor]]:
    """``(model input, labels)`` of the first ``quota`` labelled examples of ``batches``:
    whole batches, at least one (the accuracy guards of fits without validation)."""
    rows, taken = [], 0
    for batch in batches:
        labels = batch.require_labels("fit")
        if taken and taken + labels.shape[0] > quota:
            break
        rows.append((batch.model_input(), labels))
        taken += labels.shape[0]
        if taken >= quota:
            break
    return rows
