"""The steps most families run in the one epoch driver, and their batch layouts.

* :class:`ElboStep` — gradient steps on ``mean NLL over the tiled batch + β·w_i·KL/N``;
  the family passes its batch :class:`Layout`, default learning rate, optional
  minibatch KL weighting ``w_i`` and optimiser groups;
* :class:`SnapshotStep` — SGD steps on working copies without KL; the family collects
  (or schedules) around every optimiser step (SWAG moments, snapshot ensembles);
* :class:`CurvatureStep` — no optimiser, no gradient: each batch adds statistics to
  buffers (:meth:`CurvatureStep.accumulate`), which :meth:`CurvatureStep.end` sums over
  the ranks through the fit context before the family finalises (Laplace).

Layouts say how a batch of B examples becomes R rows and which posterior component
each row trains (:class:`RoundRobin`, :class:`Tiled`, :class:`WeightMembers`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bayesify.core.batch import Batch, batch_device, batch_rows, call_model, tile
from bayesify.core.fitting import FitContext, Step
from bayesify.core.outputs import logits_of
from bayesify.kit.weightspace import member_training_forward

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

ParamGroups = Callable[..., list[dict[str, Any]]]

#: every option that shapes an optimisation: a statistics pass honours none of them
OPTIMISATION_OPTIONS = ("lr", "base_lr", "kl_anneal_epochs", "beta", "optimizer", "momentum",
                        "weight_decay", "lr_schedule", "grad_accum_steps", "clip_grad_norm",
                        "epochs", "compile", "channels_last", "checkpoint_every_steps", "amp")


class Layout:
    """How a training batch of B examples becomes R rows, and the component of each row."""

    def components(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """``[R]`` component of every row (R a multiple of B: the batch tiled R/B times)."""
        return torch.zeros(batch_size, dtype=torch.long, device=device)

    def __call__(self, bnn: BayesianModel, x: Any,
                 y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[R, C]`` and targets ``[R]``: row ``r`` is example ``r % B``."""
        rows, device = batch_rows(x), batch_device(x)
        comp = self.components(rows, device)
        reps = comp.shape[0] // rows
        xt, yt = tile(x, reps), tile(y, reps)
        with bnn.context.use(comp):
            logits = logits_of(call_model(bnn.model, xt))
        return logits, yt


class RoundRobin(Layout):
    """iBNN Algorithm 1: every example repeated ``reps`` times, rows dealt to the K
    components round-robin (``row % K``), so every component trains on its own slice."""

    def __init__(self, reps: int, components: int) -> None:
        self.reps, self.k = int(reps), int(components)

    def components(self, batch_size: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.reps * batch_size, device=device) % self.k


class Tiled(Layout):
    """The batch tiled K times: every member sees every example (component = row // B)."""

    def __init__(self, components: int) -> None:
        self.k = int(components)

    def components(self, batch_size: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.k * batch_size, device=device) // batch_size


class WeightMembers(Layout):
    """Every one of ``reps`` repeats is one member (one weight sample): rows
    ``s·B … (s+1)·B−1`` form member ``s``; the mean NLL averages every sample's likelihood."""

    def __init__(self, reps: int) -> None:
        self.reps = int(reps)

    def components(self, batch_size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.reps * batch_size, dtype=torch.long, device=device)

    def __call__(self, bnn: BayesianModel, x: Any,
                 y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return member_training_forward(bnn, x, y, self.reps)


def repeats(config: Any) -> int:
    """Training repeats of every example: the config's ``samples`` (1 when it has none)."""
    return int(getattr(config, "samples", 1))


class ElboStep(Step):
    """Gradient steps on ``loss = mean NLL over the tiled batch + β(t)·w_i·KL(q‖p)/N_train``.

    ``layout``: the batch layout; ``lr``: the family's default learning rate;
    ``kl_weighting(i, M)``: the minibatch KL weight ``w_i`` (1 when ``None``);
    ``groups(bnn, lr=..., weight_decay=...)``: optimiser groups (default: one posterior
    group); ``defaults``: further fit defaults; ``refused``/``refusal``: options refused.
    """

    optimizes = True
    trains_posterior = True

    def __init__(self, layout: Layout, *, lr: float,
                 kl_weighting: Callable[[int, int], float] | None = None,
                 groups: ParamGroups | None = None, defaults: Mapping[str, Any] | None = None,
                 refused: tuple[str, ...] = (), refusal: str | None = None) -> None:
        self.layout = layout
        self.defaults = {"lr": lr, **(defaults or {})}
        self.refused = tuple(refused)
        if refusal is not None:
            self.refusal = refusal
        self.kl_weighting = kl_weighting
        self.groups = groups

    def forward(self, bnn: BayesianModel, inputs: Any,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layout(bnn, inputs, labels)

    def terms(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean NLL [], KL [])`` in fp32: KL stays fp32 under AMP."""
        with bnn.context.use(None, generator=generator):
            logits, targets = self.forward(bnn, inputs, labels)
        nll = F.cross_entropy(logits.float(), targets)
        with torch.autocast(device_type=labels.device.type, enabled=False):
            kl = bnn.kl().float()
        return nll, kl

    def kl_weight(self, index: int, total: int) -> float:
        return 1.0 if self.kl_weighting is None else float(self.kl_weighting(index, total))

    def param_groups(self, bnn: BayesianModel, *, lr: float,
                     weight_decay: float) -> list[dict[str, Any]]:
        if self.groups is None:
            return super().param_groups(bnn, lr=lr, weight_decay=weight_decay)
        return self.groups(bnn, lr=lr, weight_decay=weight_decay)


class SnapshotStep(Step):
    """SGD steps on the family's working copies, no KL term; subclasses act around every
    optimiser step (:meth:`before_update`, :meth:`after_update`) and in :meth:`end`."""

    optimizes = True

    def __init__(self, layout: Layout | None = None, *, defaults: Mapping[str, Any] | None = None,
                 refused: tuple[str, ...] = (), refusal: str | None = None) -> None:
        self.layout = layout
        self.defaults = dict(defaults or {})
        self.refused = tuple(refused)
        if refusal is not None:
            self.refusal = refusal

    def forward(self, bnn: BayesianModel, inputs: Any,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout is None:
            return super().forward(bnn, inputs, labels)
        return self.layout(bnn, inputs, labels)


class CurvatureStep(Step):
    """One gradient-free pass (eval mode, every example once over the ranks): each batch
    adds to the buffers :meth:`statistics` names, which :meth:`end` sums over the ranks
    before :meth:`finish`. Refuses every optimisation option."""

    optimizes = False
    refused = OPTIMISATION_OPTIONS
    refusal = "the family is fitted by one gradient-free pass over the data"

    def accumulate(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor) -> None:
        """Add one batch (``inputs``, ``labels [B]``) to the statistics buffers."""
        raise NotImplementedError

    def statistics(self, bnn: BayesianModel) -> list[torch.Tensor]:
        """The buffers that are sums over the data (summed over the ranks by :meth:`end`)."""
        return []

    def finish(self, ctx: FitContext) -> dict[str, Any]:
        """After the reduction: finalise the posterior; entries of the fit record."""
        return {}

    def step(self, batch: Batch, ctx: FitContext) -> None:
        with torch.no_grad():
            self.accumulate(ctx.bnn, batch.model_input(), batch.require_labels("fit"))

    def end(self, ctx: FitContext) -> dict[str, Any]:
        with torch.no_grad():
            for buffer in self.statistics(ctx.bnn):
                buffer.copy_(ctx.all_reduce_sum(buffer))
        return self.finish(ctx)


class NothingToTrainStep(CurvatureStep):
    """A family whose posterior is complete before ``fit`` (post-hoc MC dropout): the pass
    over the data adds nothing, and what ``fit`` does is its validation search (the knob
    and the temperature). ``trains_nothing`` tells ``bayesify fit`` to skip the pass."""

    trains_nothing = True

    def __init__(self, refusal: str) -> None:
        self.refusal = refusal

    def accumulate(self, bnn: BayesianModel, inputs: Any, labels: torch.Tensor) -> None:
        return None

    def step(self, batch: Batch, ctx: FitContext) -> None:
        return None


def count_correct(module: torch.nn.Module, rows: list[tuple[Any, torch.Tensor]],
                  scores: Callable[[Any], torch.Tensor], device: torch.device) -> float:
    """Correct decisions on labelled ``rows`` ``(model input, labels)`` of this process: the
    argmax of ``scores(x)`` (logits or probabilities of ``x`` moved to ``device``), with
    ``module`` in eval mode (its mode restored) — the counts the accuracy guards of fits
    without validation pass to :func:`keeps_accuracy`."""
    was_training = module.training
    module.eval()
    try:
        return float(sum(int((scores(x.to(device)).argmax(-1) == y.to(device)).sum())
                         for x, y in rows))
    finally:
        module.train(was_training)


def keeps_accuracy(ctx: FitContext, counts: torch.Tensor,
                   tolerance: float) -> tuple[int | None, list[float], int] | None:
    """The accuracy guards of fits without validation (Laplace's τ, post-hoc dropout's rate):
    ``counts`` ``[1 + C + 1]`` — correct predictions of the network, of C candidates (in the
    order to try) and the examples counted, on this process — are summed over the ranks;
    returns the first candidate whose accuracy is within ``tolerance`` of the network's (None
    when none is), the accuracies ``[network, candidates…]`` and the examples counted over
    the ranks, or None without examples."""
    counts = ctx.all_reduce_sum(counts)
    n = float(counts[-1])
    if n == 0:
        return None
    accuracy = (counts[:-1] / n).tolist()
    chosen = next((k for k in range(len(accuracy) - 1)
                   if accuracy[k + 1] >= accuracy[0] - tolerance - 1e-12), None)
    return chosen, accuracy, int(n)
