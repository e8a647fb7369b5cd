"""The robustness signal of the knob search: shifted copies of the validation inputs.

A clean validation split cannot see shift: a spread chosen on it alone shrinks to
the starting network. The search therefore also scores every candidate on
perturbed copies of the validation inputs, made here, without knowing the
domain. Three perturbations, applied to every input tensor of a batch:

* ``noise``: ``x + a·s·ε`` with ``s`` the standard deviation of ``x`` over the
  batch (a sensor-noise shift whatever the input scale);
* ``mask``: every element replaced, with probability ``p``, by the batch mean of
  its position (occlusion, dead pixels, missing features);
* ``mix``: ``(1 − λ)·x + λ·x_π`` with ``x_π`` another example of the batch
  (content of another input leaking in: clutter, superposition).

Integer inputs (token ids) get the discrete analogue of ``mask`` and ``mix``:
tokens replaced, with probability ``p`` (``λ``), by the token at the same position
of another example of the batch; positions where an ``attention_mask`` is 0, the
first position and the first and last attended ones (``[CLS]``/``<s>``,
``[SEP]``/``<eos>``) are kept, and no token is taken from another example's first or
last attended position (BART and T5 classify the ``<eos>`` token's state and refuse a
sequence with more or fewer of them). ``noise`` leaves integer
tensors as they are. Masks, type ids and booleans are never perturbed.

**How strong.** Mild perturbations do not show the failure that matters: a
network that keeps most of its accuracy on them is best served by *sharpening*,
the opposite of what unseen shifts need (measured: the validation NLL under a
perturbation that keeps 80–90 per cent accuracy is *anti*-correlated with NLL
under held-out shifts across the knob × temperature grid, Spearman −0.4–0.1;
under one that halves the accuracy the correlation is 0.5–0.97). So the strength
of every kind is set on the starting network: the smallest level of a ladder at
which its accuracy falls to half-way between its clean accuracy and chance. The
same data-free rule holds for pixels, features and tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bayesify.core.batch import Batch

#: severity ladders, mildest first (noise: multiple of the std; mask/mix: probability / weight)
LADDERS: dict[str, tuple[float, ...]] = {
    "noise": (0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
    "mask": (0.1, 0.2, 0.35, 0.5, 0.7, 0.9),
    "mix": (0.2, 0.35, 0.5, 0.65),
}
KINDS: tuple[str, ...] = tuple(LADDERS)
#: names of integer inputs that are structure, not content
_STRUCTURAL = ("mask", "type_ids", "position", "segment")


def is_content(name: str | None, tensor: torch.Tensor) -> bool:
    if tensor.dtype == torch.bool:
        return False
    return name is None or not any(part in name for part in _STRUCTURAL)


def _perturb_float(x: torch.Tensor, kind: str, level: float, g: torch.Generator,
                   perm: torch.Tensor) -> torch.Tensor:
    work = x.float()
    if kind == "noise":
        scale = work.std() if work.numel() > 1 else work.new_tensor(1.0)
        eps = torch.randn(work.shape, generator=g).to(work.device)
        out = work + level * torch.nan_to_num(scale, nan=1.0) * eps
    elif kind == "mask":
        hit = (torch.rand(work.shape, generator=g) < level).to(work.device)
        out = torch.where(hit, work.mean(0, keepdim=True).expand_as(work), work)
    else:  # mix
        out = (1.0 - level) * work + level * work[perm.to(work.device)]
    return out.to(x.dtype)


def _perturb_tokens(x: torch.Tensor, kind: str, level: float, g: torch.Generator,
                    perm: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    if kind == "noise" or x.dim() < 2:
        return x
    hit = (torch.rand(x.shape, generator=g) < level).to(x.device)
    hit[:, 0] = False  # a [CLS]-like first token stays
    attended = (keep.bool().to(x.device) if keep is not None and keep.shape == x.shape
                else torch.ones(x.shape, dtype=torch.bool, device=x.device))
    # the first and last attended tokens ([CLS]/<s>, [SEP]/<eos>: BART and T5 classify the
    # <eos> token's state and refuse a sequence with more or fewer of them) stay, and no
    # token is taken from another example's first or last
    index = torch.arange(x.shape[1], device=x.device)
    first = torch.where(attended, index, x.shape[1]).amin(1, keepdim=True)
    last = torch.where(attended, index, -1).amax(1, keepdim=True)
    edge = (index == first) | (index == last)
    donor = perm.to(x.device)
    hit &= attended & ~edge & ~edge[donor]
    return torch.where(hit, x[donor], x)


def perturb(batch: Batch, kind: str, level: float, *, seed: int) -> Batch:
    """A perturbed copy of ``batch``'s inputs (labels kept); ``seed`` fixes the draw.

    ``kind`` is ``"noise"``, ``"mask"`` or ``"mix"``; ``level`` its strength (0 is the
    identity). See the module docstring for what each does to float and integer inputs.
    """
    if kind not in LADDERS:
        raise ValueError(f"unknown perturbation {kind!r}; use one of {KINDS}")
    if level == 0:
        return batch
    rows = batch.size
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(rows, generator=g) if rows > 1 else torch.zeros(1, dtype=torch.long)
    keep = batch.kwargs.get("attention_mask")

    def apply(name: str | None, v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != rows:
            return v
        if not is_content(name, v):
            return v
        if v.is_floating_point():
            return _perturb_float(v, kind, level, g, perm)
        if not v.is_complex():
            return _perturb_tokens(v, kind, level, g, perm, keep)
        return v

    return Batch(tuple(apply(None, a) for a in batch.args),
                 {k: apply(k, v) for k, v in batch.kwargs.items()}, batch.labels)


@dataclass(frozen=True)
class ShiftSignal:
    """Perturbations at calibrated strengths: ``copies(batch, index)`` gives one shifted
    copy of the batch per kind, drawn from ``seed`` and the batch's position ``index``
    (so every knob value of a search sees the same shifted inputs)."""

    levels: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    #: this process's first batch's position in the whole split (the ranks before it hold
    #: that many batches): a batch's copies are drawn from its position in the split, so
    #: shards of whole batches get the copies one process would
    first_index: int = 0

    def copies(self, batch: Batch, index: int) -> list[Batch]:
        """``index``: the batch's position in this process's shard."""
        position = self.first_index + index
        return [perturb(batch, kind, level, seed=self.seed + 1009 * position + 17 * i)
                for i, (kind, level) in enumerate(sorted(self.levels.items()))]

    def describe(self) -> dict[str, float]:
        return dict(sorted(self.levels.items()))


@torch.no_grad()
def calibrate_shift(logits_fn: Callable[[Batch], torch.Tensor],
                    batches: Callable[[], Iterable[Batch]], *,
                    kinds: Sequence[str] = KINDS, seed: int = 0,
                    max_examples: int = 1024) -> ShiftSignal:
    """The strength of every kind at which the starting network (``logits_fn``: a batch →
    logits ``[B, C]``) keeps half of its accuracy above chance (see the module docstring).

    ``batches()`` streams the validation split (one batch at a time; every pass stops after
    ``max_examples`` examples, so memory does not grow with the split). A kind whose
    strongest level still keeps more is used at its strongest level, and a kind that
    changes nothing (``noise`` on token inputs) is dropped.
    """
    classes = 2

    def accuracy(kind: str | None, level: float) -> float | None:
        nonlocal classes
        correct, total = 0.0, 0
        for i, b in enumerate(batches()):
            if kind is not None and i == 0 and not _changes_inputs(b, kind):
                return None
            shifted = b if kind is None else perturb(b, kind, level, seed=seed + 1009 * i)
            logits = logits_fn(shifted).float()
            classes = int(logits.shape[-1])
            labels = b.require_labels("the shift signal").to(logits.device)
            correct += float((logits.argmax(-1) == labels).sum())
            total += b.size
            if total >= max_examples:
                break
        return correct / total if total else None

    clean = accuracy(None, 0.0)
    if clean is None:
        return ShiftSignal({}, seed)
    chance = 1.0 / max(classes, 2)
    target = chance + 0.5 * max(clean - chance, 0.0)
    levels: dict[str, float] = {}
    for kind in kinds:
        chosen: float | None = LADDERS[kind][-1]
        for level in LADDERS[kind]:
            acc = accuracy(kind, level)
            if acc is None:  # this kind changes nothing in these inputs
                chosen = None
                break
            if acc <= target:
                chosen = level
                break
        if chosen is not None:
            levels[kind] = chosen
    return ShiftSignal(levels, seed)


def _changes_inputs(batch: Batch, kind: str) -> bool:
    shifted = perturb(batch, kind, LADDERS[kind][-1], seed=0)
    return any(not torch.equal(a, b) for a, b in zip(batch.tensors(), shifted.tensors()))
