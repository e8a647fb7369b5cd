"""The sampling plan shared by the layers injected into one model.

A :class:`BayesianModel` owns one :class:`SamplingContext`; every injected layer
holds a reference to it (never a global). Before a forward pass the model sets a
plan: which posterior component each row of the (tiled) batch belongs to, and
whether noise is drawn or replaced by its posterior mean. Each layer reads the
row → component map and draws its own noise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from bayesify.errors import BayesifyError


def expand_plan_rows(index: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """A plan's per-row index ``[R]`` stretched to a layer that sees ``rows`` rows.

    A parent that reshapes its batch batch-major (e.g. window attention,
    ``[B·W, ...]``) repeats every planned row ``rows / R`` times.
    """
    planned = index.shape[0]
    if rows == planned:
        return index.to(device)
    if rows % planned == 0:
        return index.to(device).repeat_interleave(rows // planned)
    raise BayesifyError(
        f"a wrapped layer received {rows} rows but the sampling plan has {planned}; "
        "the model reshapes its batch in a way bayesify cannot follow — exclude "
        "this layer with exclude=[...]"
    )


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass with gradients on: gradient
    checkpointing recomputing a segment of the forward."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


@dataclass
class SamplingPlan:
    """Row → component assignment for one forward pass.

    ``component``: ``[R]`` long tensor, the component (member) of every row.
    ``deterministic``: use posterior means instead of sampling.
    ``generator``: optional RNG for reproducible per-row noise.
    ``member``: optional ``[R]`` predictive member of every row. When set, noise
    is drawn once per member (shared by all rows of that member), so prediction
    evaluates M fixed networks, independent of batch size and chunking.
    ``num_members``: M, the total number of members (when ``member`` is set).
    ``seed``: with ``member``, every layer draws its ``[M, ...]`` noise from a
    generator seeded by ``(seed, layer_id)``: reproducible and exportable.
    """

    component: torch.Tensor | None = None
    deterministic: bool = False
    generator: torch.Generator | None = None
    member: torch.Tensor | None = None
    num_members: int = 0
    seed: int | None = None


class SamplingContext:
    """Holds the active :class:`SamplingPlan`; shared by reference by all layers."""

    def __init__(self, components: int) -> None:
        self.components = int(components)
        self._plan = SamplingPlan()
        #: open ``use`` blocks, and the plan the last one set (see :attr:`plan`)
        self._depth = 0
        self._last: SamplingPlan | None = None
        self.force_deterministic = False
        self._layer_count = 0
        #: counts top-level forward passes (every ``use`` block and every
        #: ``BayesianModel.forward``) when a family caches per-pass draws keyed by it
        #: (``track_passes``, hypernet's shared noise); off otherwise, so compiled
        #: steps see no changing Python state
        self.pass_id = 0
        self.track_passes = False
        #: the layout probe (bayesify.core.layout): done once per model; running now
        self.layout_probed = False
        self.probing = False

    def new_pass(self) -> None:
        if self.track_passes:
            self.pass_id += 1

    def next_layer_id(self) -> int:
        """A distinct id per injected layer (seeds its per-member noise stream)."""
        self._layer_count += 1
        return self._layer_count - 1

    @contextlib.contextmanager
    def use(
        self,
        component: torch.Tensor | None = None,
        *,
        deterministic: bool | None = None,
        generator: torch.Generator | None = None,
        member: torch.Tensor | None = None,
        num_members: int = 0,
        seed: int | None = None,
    ) -> Iterator[SamplingPlan]:
        previous = self._plan
        self.new_pass()
        det = previous.deterministic if deterministic is None else deterministic
        gen = generator if generator is not None else previous.generator
        self._plan = SamplingPlan(
            component=component, deterministic=det, generator=gen,
            member=member, num_members=num_members, seed=seed,
        )
        self._last = self._plan
        self._depth += 1
        try:
            yield self._plan
        finally:
            self._depth -= 1
            self._plan = previous

    @property
    def plan(self) -> SamplingPlan:
        """The active plan. Inside a backward pass with no ``use`` block open — gradient
        checkpointing (``torch.utils.checkpoint``; Hugging Face's
        ``gradient_checkpointing_enable()``) recomputing a segment of the forward — the plan
        of the forward it recomputes (the last one set): without it the recomputed layers
        dealt their rows to other members than the forward had (BatchEnsemble, rank-1: the
        gradients of their factors wrong by up to 8× their size, silently). Noise drawn
        from a ``torch.Generator`` cannot be drawn again there (checkpointing replays the
        global RNG only): that is an error, not a silently different draw."""
        if self._depth == 0 and self._last is not None and recomputing():
            last = self._last
            if last.generator is not None and not last.deterministic:
                raise BayesifyError(
                    "gradient checkpointing recomputes the wrapped layers in the backward pass, "
                    "where the noise bayesify drew from its generator cannot be drawn again "
                    "(the recomputed forward would differ from the one the loss saw). fit "
                    "draws from the global RNG instead for a model whose checkpointing it "
                    "sees (Hugging Face's model.gradient_checkpointing_enable(), timm's "
                    "model.set_grad_checkpointing()); for "
                    "checkpointing of your own, turn it off for the fit, or train with "
                    "elbo_loss / BayesTrainer (global RNG, which checkpointing replays)")
            return last
        return self._plan

    @property
    def deterministic(self) -> bool:
        return self.force_deterministic or self.plan.deterministic

    def planned_rows(self) -> int | torch.SymInt | None:
        """Rows of the active plan (its component or member index; symbolic where an export
        traces the batch), None without one."""
        plan = self.plan
        index = plan.component if plan.component is not None else plan.member
        return None if index is None else index.shape[0]

    def components_for(self, rows: int, device: torch.device) -> torch.Tensor:
        """``[rows]`` component index per row of a layer's input.

        A layer may see more rows than the plan when a parent reshapes the batch
        batch-major (e.g. window attention: ``[B·W, ...]``); the assignment is
        then repeated per row block. Without a plan, rows are dealt round-robin.
        """
        comp = self.plan.component
        if comp is None:
            return torch.arange(rows, device=device) % self.components
        return expand_plan_rows(comp, rows, device)

    def draw(
        self,
        layer_id: int,
        rows: int,
        tail: tuple[int, ...],
        device: torch.device,
        *,
        uniform: bool = False,
        then: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``[rows, *tail]`` fp32 noise (standard normal, or U[0, 1) if ``uniform``).

        Per row in training; per member (shared by its rows) when the plan names
        members, seeded per layer so member m sees the same network every call.
        ``then`` maps the noise before it is spread over the rows: per member it runs on the
        ``[M, *tail]`` draw, not on the ``[rows, *tail]`` gather (MC dropout's masks on a
        ViT's activations: one pass over the rows instead of four).
        """
        plan = self.plan
        if plan.member is None:
            shape = (rows, *tail)
            if uniform:
                noise = torch.rand(shape, device=device, generator=plan.generator)
            else:
                noise = torch.randn(shape, device=device, generator=plan.generator)
            return noise if then is None else then(noise)
        shape = (plan.num_members, *tail)
        generator = plan.generator
        if plan.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed((plan.seed * 1_000_003 + layer_id * 7_919) % (2**62))
        noise = (torch.rand if uniform else torch.randn)(shape, device=device, generator=generator)
        if then is not None:
            noise = then(noise)
        return noise.index_select(0, expand_plan_rows(plan.member, rows, device))
