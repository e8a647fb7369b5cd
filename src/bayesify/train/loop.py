"""``bayesify.fit``: the one epoch driver of every family.

A family is a config, layers and a step: ``bnn.method.step()`` returns the
:class:`~bayesify.core.fitting.Step` this driver runs — ``begin(ctx)`` once,
``step(batch, ctx)`` for every batch, ``end(ctx)`` after the last — with a fit context
(:class:`~bayesify.train.context.TrainContext`) that provides sharded iteration,
reductions that name dead ranks, AMP, logging, the gradient-step service and the knob
search. ELBO, SGD-snapshot (SWAG, snapshot ensembles) and curvature (Laplace) are three
such steps; progress bar, history, checkpoints, resume and callbacks are the driver's,
for every family. An option a step cannot honour is an error naming the family and
the option.

Data parallel (DESIGN.md §5): launched by ``torchrun`` the driver initialises the
process group (nccl on CUDA, gloo on CPU), shards every global batch over the
ranks (:mod:`bayesify.train.data`), calls the model through
``DistributedDataParallel`` (frozen base weights have ``requires_grad=False`` and
are ignored by DDP, so only trainable tensors are all-reduced), gives every rank
its own noise stream, averages logged terms over ranks and logs/checkpoints on
rank 0. A step that takes no optimiser steps (``Step.optimizes`` false) makes one pass
in eval mode over this rank's contiguous shard (every example once over the ranks).
Checkpoints (:mod:`bayesify.train.resume`) make a killed run resumable to the same
final posterior.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.batch import BatchFn, call_model, rng_devices
from bayesify.core.checks import check_finite_batch, check_labels, explain_shapes
from bayesify.core.outputs import check_not_probabilities, logits_of
from bayesify.errors import BayesifyError, NonFiniteLossError
from bayesify.kit import laplace_heads
from bayesify.progress import progress_bar
from bayesify.train import evaluate as evaluation
from bayesify.train import resume as ckpt
from bayesify.train.best import BestState, adopt_search, clearly_worse, kept_accuracy
from bayesify.train.budget import (  # noqa: F401 - re-exported
    DEFAULT_FORWARDS,
    DEFAULT_MIN_STEPS,
    EPOCHS_HELP,
    REFERENCE_BATCH,
    budget_epochs,
    default_epochs,
    default_min_steps,
    small_batch_factor,
)
from bayesify.train.clock import FitClock
from bayesify.train.context import TrainContext, TrainState
from bayesify.train.data import TrainData, training_set_size
from bayesify.train.distributed import (
    DistContext,
    agree_on_job,
    all_reduce_sum,
    broadcast_object,
    describe_job,
    naming_unresponsive_ranks,
    rank_seed,
    rank_zero_warnings,
    setup_distributed,
)
from bayesify.train.guard import buffers_restored_on_error
from bayesify.train.hooks import (
    Callback,
    FitWatch,
    HistoryLog,
    as_callback,
    starting_metrics,
)
from bayesify.train.options import validate_fit_options
from bayesify.train.schedules import parse_schedule
from bayesify.train.spread_guard import guard_spread
from bayesify.train.start_guard import StartGuard
from bayesify.train.steps import (
    SeededCompiledForward,
    TrainForward,
    build_optimizer,
    flush_group,
    train_step,
)
from bayesify.train.tuning import neutral_knobs, one_sample_per_component, search_with_heads

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

__all__ = ["FitResult", "TrainContext", "TrainState", "build_optimizer", "fit", "train_step"]


logger = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What ``fit`` returns: one dict per epoch (loss, nll, kl, beta, lr, val_*)."""

    history: list[dict[str, Any]] = field(default_factory=list)
    last_checkpoint: str | None = None

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.history[i]

    def __len__(self) -> int:
        return len(self.history)

    @property
    def last(self) -> dict[str, Any]:
        return self.history[-1]


#: fit options and their defaults (None: the family's default, else the fallback)
FIT_FALLBACKS = {"momentum": 0.9, "weight_decay": 0.0, "lr_schedule": "constant", "optimizer": "sgd"}


def fit(
    bnn: BayesianModel,
    train_loader: Iterable,
    *,
    epochs: int | None = None,
    min_steps: int | None = None,
    lr: float | None = None,
    base_lr: float = 0.0,
    kl_anneal_epochs: float = 0.0,
    beta: float = 1.0,
    lr_schedule: Any = None,
    base_lr_schedule: Any = "constant",
    optimizer: str | None = None,
    momentum: float | None = None,
    weight_decay: float | None = None,
    base_weight_decay: float = 0.0,
    n_train: int | None = None,
    val_loader: Iterable | None = None,
    shift_loader: Iterable | None = None,
    batch_fn: BatchFn | None = None,
    device: str | torch.device | None = None,
    log_dir: str | Path | None = None,
    progress: bool = True,
    seed: int | None = None,
    amp: bool | None = None,
    channels_last: bool = False,
    compile: bool | dict[str, Any] = False,
    grad_accum_steps: int = 1,
    clip_grad_norm: float | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every_steps: int = 0,
    keep_checkpoints: int = 2,
    resume: str | Path | None = None,
    callbacks: Sequence[Any] = (),
    val_every: int | None = None,
    val_samples_per_component: int | None = None,
    find_unused_parameters: bool = False,
    timeout_s: float | None = None,
    **unknown: Any,
) -> FitResult:
    """Fit the posterior of ``bnn`` on ``train_loader`` (one epoch driver for every family).

    ``epochs=None`` (the default) trains as many whole epochs as it takes to reach
    :data:`DEFAULT_FORWARDS` (8,192) forward passes of one training example, an example
    tiled to R rows by the family costing R (:mod:`bayesify.train.budget`; at least one
    epoch): 14 epochs of 300 images for iBNN, one epoch of ImageNet; ``min_steps=N`` asks
    for whole epochs until N optimiser steps instead. After the first steps ``fit`` logs
    how long the whole fit will take (:mod:`bayesify.train.clock`). Post-hoc families
    (Laplace) make one pass whatever the budget.

    The family's step (``bnn.method.step()``) runs every batch. ELBO families: loss
    per step = mean NLL over the tiled batch + β(t)·KL/N_train,
    β(t) linear 0 → ``beta`` over ``kl_anneal_epochs`` (fixed when 0); SGD
    Nesterov at ``lr`` (default: the family's, scaled down below 16 examples per optimiser
    step, :func:`~bayesify.train.budget.small_batch_factor`), no weight decay on the posterior;
    base weights stay frozen unless ``base_lr > 0``. Snapshot families (SWAG,
    snapshot ensembles) take SGD steps at the family's LR/momentum/weight decay and
    collect the iterates; Laplace makes one curvature pass. ``lr_schedule`` /
    ``base_lr_schedule``: see :func:`bayesify.train.schedules.lr_factor`.
    ``shift_loader``: labelled inputs under the shift you expect; the validation search
    then uses them as its robustness signal instead of the library's perturbations.
    ``val_loader``: validation metrics after the last epoch, after earlier ones while that
    costs under a quarter of the training work, counted in forward passes, not timed
    (:mod:`bayesify.train.clock`; or every ``val_every`` epochs when given),
    the best validated state kept when the last is clearly worse than the starting
    network (:mod:`bayesify.train.best`) and, for families
    with a predictive-scale knob, the validation-tuned choice of it at the end (the
    knob search, :mod:`bayesify.train.tuning`; ``bayesify.tune`` runs it on its own).
    Without ``val_loader`` a spread knob keeps the largest of 1, ½, ¼, 0.1 (else 0) whose
    predictive keeps the mean network's accuracy on the first 1,024 training examples
    within a point (:mod:`bayesify.train.spread_guard`).
    ``batch_fn``: how to split a batch the loader yields (see
    :mod:`bayesify.core.batch`).

    Under ``torchrun`` the loader's ``batch_size`` is per rank (global batch =
    batch_size × world size) and the data order of epoch e is a function of
    ``(seed, e)``, as it is in a single process whenever ``seed``,
    ``checkpoint_dir`` or ``resume`` is given. ``amp`` (default: on for CUDA)
    runs the forward in bf16 autocast; KL and noise stay fp32. ``checkpoint_dir``:
    an atomic checkpoint after every epoch (and every ``checkpoint_every_steps``
    optimiser steps), the newest ``keep_checkpoints`` kept; ``resume``: a
    checkpoint file or directory to continue from. ``callbacks``: objects with
    optional ``on_step_end(state, terms)`` / ``on_epoch_end(state, record)``
    (a plain callable is ``on_epoch_end``), called after the checkpoint is written.
    A non-finite loss or step raises :class:`NonFiniteLossError` with the last
    finite posterior in memory. ``timeout_s``: how long a collective waits for the
    other ranks under ``torchrun`` before the error names the rank that did not
    answer (default 10 minutes).
    """
    validate_fit_options(**locals())  # every option checked before anything changes
    _refuse_half_precision(bnn)
    method = bnn.method
    if unknown:
        raise BayesifyError(f"unknown fit option(s) {sorted(unknown)} for method "
                            f"{method.name!r}; see help(bayesify.fit)")
    step = method.step()
    given = {"lr": lr, "base_lr": base_lr or None, "kl_anneal_epochs": kl_anneal_epochs or None,
             "beta": None if beta == 1.0 else beta, "optimizer": optimizer,
             "momentum": momentum, "weight_decay": weight_decay, "lr_schedule": lr_schedule,
             "grad_accum_steps": None if grad_accum_steps == 1 else grad_accum_steps,
             "clip_grad_norm": clip_grad_norm, "epochs": None if epochs in (None, 1) else epochs,
             "compile": compile or None, "channels_last": channels_last or None,
             "checkpoint_every_steps": checkpoint_every_steps or None, "amp": amp}
    refused = [k for k in step.refused if given.get(k) is not None]
    if refused:
        raise BayesifyError(
            f"method {method.name!r} cannot honour fit option(s) {refused}: {step.refusal}"
        )
    defaults = {**FIT_FALLBACKS, **step.defaults}
    lr_given = lr is not None
    lr = lr if lr_given else defaults.get("lr", 0.1)
    momentum = defaults["momentum"] if momentum is None else momentum
    weight_decay = defaults["weight_decay"] if weight_decay is None else weight_decay
    lr_schedule = defaults["lr_schedule"] if lr_schedule is None else lr_schedule
    optimizer = defaults["optimizer"] if optimizer is None else optimizer
    if clip_grad_norm is None:
        clip_grad_norm = defaults.get("clip_grad_norm")
    ctx = setup_distributed(device, bnn.device, timeout_s=timeout_s)
    # a silent rank is named, not a bare timeout; only rank 0 warns
    with naming_unresponsive_ranks(ctx), rank_zero_warnings(ctx):
        if device is not None or ctx.device != bnn.device:
            bnn.to(ctx.device)
        # before the first collective: every output location is writable and (torchrun)
        # every rank runs the same job, or every rank stops with the same error
        agree_on_job(ctx, functools.partial(describe_job, bnn, train_loader, dict(locals())),
                     refusal=ckpt.probe_outputs(checkpoint_dir=checkpoint_dir, log_dir=log_dir)
                     if ctx.is_main else None)
        checkpointing = checkpoint_dir is not None or resume is not None
        payload = ckpt.read_for_resume(resume, ctx) if resume is not None else None
        state = TrainContext(
            bnn=bnn, optimizer=None, base_lrs=[], schedules=[], epochs=epochs,
            steps_per_epoch=0, n_train=0, kl_anneal_epochs=kl_anneal_epochs, beta_max=beta,
            ctx=ctx, amp=(ctx.device.type == "cuda") if amp is None else bool(amp),
            channels_last=channels_last, grad_accum_steps=grad_accum_steps,
            clip_grad_norm=clip_grad_norm, family=step, train_loader=train_loader,
            val_loader=val_loader, shift_loader=shift_loader, batch_fn=batch_fn,
            show_progress=progress,
        )
        if step.optimizes:
            options = _optimisation(state, train_loader, payload, lr=lr, base_lr=base_lr,
                                    lr_schedule=lr_schedule, base_lr_schedule=base_lr_schedule,
                                    optimizer=optimizer, momentum=momentum,
                                    weight_decay=weight_decay,
                                    base_weight_decay=base_weight_decay, n_train=n_train,
                                    seed=seed, checkpointing=checkpointing,
                                    min_steps=min_steps, lr_given=lr_given)
        else:  # a statistics pass: one epoch, eval mode, every example once over the ranks
            state.epochs, state.amp = 1, False
            state.data = TrainData(train_loader, ctx=ctx, seed=0, seeded=False, exact=True)
            state.steps_per_epoch = state.data.batches_per_epoch
            options = {"training": "curvature"}
        run = ckpt.Run(directory=Path(checkpoint_dir) if checkpoint_dir is not None else None,
                       keep=keep_checkpoints, every=checkpoint_every_steps,
                       options={**options, **ckpt.result_options(state)},
                       identity=ckpt.identity(bnn) if checkpointing else {})
        if payload is not None:
            ckpt.restore(state, payload, run, path=payload["path"])
        else:
            for knob in method.knobs(bnn):
                if knob.initial is not None:
                    knob.set(knob.initial)
            step.begin(state)
        started = time.perf_counter()
        start = (starting_metrics(bnn, val_loader, ctx, batch_fn=batch_fn, amp=state.amp,
                                  progress=progress)
                 if val_loader is not None and payload is None else None)
        clock = FitClock(state, start_seconds=time.perf_counter() - started if start else None,
                         val_every=val_every, samples_per_component=val_samples_per_component)
        # a resumed fit takes what the never-worse rules had seen from its checkpoint
        best = BestState(state, start, fresh=payload is None, batch_fn=batch_fn,
                         samples_per_component=val_samples_per_component,
                         carried=ckpt.carried(payload, "best"))
        start = best.start if best.active else start
        start_guard = StartGuard(state, fresh=payload is None,  # without a val_loader
                                 carried=ckpt.carried(payload, "start_guard"))
        state.carried = {"best": best, "start_guard": start_guard}
        validate = functools.partial(evaluation.evaluate_sharded, bnn, val_loader, ctx,
                                     samples_per_component=val_samples_per_component,
                                     amp=state.amp, channels_last=channels_last,
                                     batch_fn=batch_fn, progress=progress)
        if step.optimizes:
            _forward(state, compile=compile, find_unused_parameters=find_unused_parameters)
        result = FitResult(history=state.history)
        watch = FitWatch(state, fresh=payload is None,
                         chosen=lr_given or epochs is not None or min_steps is not None)
        log = HistoryLog(log_dir, ctx)
        hooks = [as_callback(c) for c in callbacks] + ([as_callback(clock)] if step.optimizes
                                                        else [])
        ended = False  # whether this call ran the last epoch (a finished run resumed: no)
        while state.epoch < state.epochs:
            # a statistics pass (no optimiser) that fails half-way leaves no half-accumulated
            # state behind: its buffers are put back (gradient steps have the step guard)
            with contextlib.nullcontext() if step.optimizes else buffers_restored_on_error(bnn):
                record = _run_epoch(state, progress=progress and ctx.is_main, run=run, hooks=hooks,
                                    watch=watch)
                is_last = state.epoch + 1 == state.epochs
                ended |= is_last
                if is_last:
                    record.update(step.end(state))
                    if val_loader is not None:
                        record.update(_search(state, method))
                    else:
                        if laplace_heads.enabled(bnn):
                            record.update(laplace_heads.skipped(method.name))
                        if step.optimizes:  # no validation: the spread keeps the accuracy
                            def guard() -> dict[str, Any]:
                                return guard_spread(state, method.knobs(bnn))

                            record.update(guard())
                            # and the end keeps the start's training accuracy
                            start_guard.finish(record, method.name, guard)
            if val_loader is not None and clock.should_validate(record, epoch=state.epoch,
                                                                is_last=is_last):
                began = time.perf_counter()
                # the global RNG stream of training is left as it was: whether an epoch is
                # validated (a timing decision, FitClock) must not change the next epochs
                with torch.random.fork_rng(devices=rng_devices(ctx.device)):
                    metrics = validate(desc=f"validate epoch {state.epoch + 1}")
                record["val_seconds"] = clock.validated(time.perf_counter() - began)
                record.update({f"val_{k}": v for k, v in metrics.items() if isinstance(v, float)})
                best.see(record, is_last=is_last)
            state.history.append(record)
            state.epoch, state.step, state.totals = state.epoch + 1, 0, {}
            if run.directory is not None:
                result.last_checkpoint = ckpt.save(state, run)
            log.write(record)
            for hook in hooks:
                hook.on_epoch_end(state, record)
        bnn.eval()
        # about the trajectory, before a state is restored
        watch.finish(state, method.name,
                     predictive=kept_accuracy(state.history[-1], start) if state.history else None)
        if start is not None and state.history and ended:
            state.history[0].update({f"start_val_{k}": v for k, v in start.items()})
            # never worse than the start
            best.finish(state.history[-1], method.name, refused=tuple(step.refused))
            record = state.history[-1]
            search = functools.partial(_search_and_validate, state, method, validate)
            if record.get("kept", "last") != "last":  # only with a val_loader
                # the search's knobs and T belong to the state they were searched on: a kept
                # earlier state (or the start: every knob neutral, T = 1) is searched again
                adopt_search(record, *search())
                if ctx.is_main:
                    logger.info("fit of %r: the kept state (%s) searched again: validation "
                                "accuracy %.4f, NLL %.4f", method.name, record["kept"],
                                record["kept_val_accuracy"], record["kept_val_nll"])
            held, kept = state.search_warnings, record.get("kept", "last")
            neutral = (functools.partial(_search_from_the_network, state, method)
                       if laplace_heads.enabled(bnn) else None)
            best.retry_start(record, search, neutral=neutral,
                             measure=functools.partial(_validated, validate),
                             family_shift=state.search_scores.get("shift"),
                             scores=state.search_scores)
            if record.get("kept", "last") == kept:  # the start's search, if any, not adopted
                state.search_warnings = held
            if "kept_val_nll" in record:
                record["worse_than_start"] = bool(clearly_worse(
                    start, {"val_nll": record["kept_val_nll"],
                            "val_accuracy": record["kept_val_accuracy"]}))
            bnn.eval()
            if run.directory is not None and record.get("kept", "last") != "last":
                # the last checkpoint holds the state that is handed back: resuming the
                # finished run gives the kept state, not the one keep-best set aside
                result.last_checkpoint = ckpt.save(state, run)
        _release_warnings(state)
        return result


def _search(state: TrainContext, method: Any, *, knobs: list[Any] | None = None) -> dict[str, Any]:
    """The validation search of the model's current state (:func:`search_with_heads`).

    Its warnings (a knob at an end of its grid) are held in ``state.search_warnings``, not
    shown: the never-worse rule may hand back another state, searched again, and a user
    then read advice about a discarded state beside the kept one's, e.g. "rank1_noise_scale =
    0, the narrowest end" and "= 2, the broadest end" from one fit (a held-out ConvNeXt).
    :func:`_release_warnings` shows the adopted search's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = search_with_heads(state.bnn, state.tune, state.clean_scores, state, knobs=knobs)
    state.search_warnings = list(caught)
    return record


def _release_warnings(state: TrainContext) -> None:
    """Show the held warnings of the search whose state fit hands back, at the line that
    called ``fit`` (the caller's warning filters apply now, as they would have then)."""
    held, state.search_warnings = state.search_warnings, []
    seen = set()
    for w in held:  # recorded with "always": once per message and place, as shown by default
        key = (str(w.message), w.category, w.filename, w.lineno)
        if key not in seen:
            seen.add(key)
            warnings.warn(w.message, stacklevel=3)  # 1 here, 2 fit, 3 fit's caller


def _search_and_validate(state: TrainContext, method: Any,
                         validate: Callable[..., dict[str, Any]], *,
                         knobs: list[Any] | None = None) -> tuple[dict, dict]:
    """The knob search on the model's current state (``knobs``: :func:`search_with_heads`'s),
    then its validation metrics."""
    search = _search(state, method, knobs=knobs)
    return search, _validated(validate)


def _validated(validate: Callable[..., dict[str, Any]]) -> dict[str, float]:
    """The validation NLL and accuracy of the model's current state."""
    metrics = validate(desc="validate the kept state")
    return {"val_nll": float(metrics["nll"]), "val_accuracy": float(metrics["accuracy"])}


def _search_from_the_network(state: TrainContext, method: Any) -> dict[str, Any]:
    """:func:`_search` of the starting state with every knob neutral (each member the
    network: :func:`~bayesify.train.tuning.neutral_knobs`), one sample per component where
    that makes the samples equal."""
    knobs = neutral_knobs(method.knobs(state.bnn))
    with one_sample_per_component(state.bnn, knobs):
        return _search(state, method, knobs=knobs)


def _optimisation(state: TrainContext, train_loader: Iterable, payload: dict[str, Any] | None, *,
                  lr: float, base_lr: float, lr_schedule: Any, base_lr_schedule: Any,
                  optimizer: str, momentum: float, weight_decay: float,
                  base_weight_decay: float, n_train: int | None, seed: int | None,
                  checkpointing: bool, min_steps: int | None = None,
                  lr_given: bool = True) -> dict[str, Any]:
    """Optimiser, schedules, seeded sharded data and noise stream of a gradient step;
    returns the fit options a checkpoint must match."""
    bnn, ctx = state.bnn, state.ctx
    n_train = n_train or _dataset_size(train_loader, state.batch_fn)
    lr_schedule, base_lr_schedule = parse_schedule(lr_schedule), parse_schedule(base_lr_schedule)
    if seed is None and payload is not None:
        seed = int(payload["meta"]["options"]["seed"])
    seeded = seed is not None or checkpointing or ctx.distributed
    if seed is None:
        seed = broadcast_object(int(torch.randint(0, 2**31 - 1, ()).item()), ctx)
    if ctx.distributed:  # families drawing from the global RNG get per-rank streams too
        torch.manual_seed(rank_seed(seed, ctx.rank) % (2**31))
    state.data = TrainData(train_loader, ctx=ctx, seed=seed, seeded=seeded)
    state.steps_per_epoch = state.data.batches_per_epoch
    if not lr_given:  # the family's default rate assumes ≥ REFERENCE_BATCH examples a step
        lr = _small_batch_lr(state, lr, n_train=n_train, optimizer=optimizer)
    opt = build_optimizer(bnn, lr=lr, base_lr=base_lr, optimizer=optimizer, momentum=momentum,
                          weight_decay=weight_decay, base_weight_decay=base_weight_decay,
                          step=state.family)
    state.optimizer, state.n_train = opt, n_train
    state.base_lrs = [g["lr"] for g in opt.param_groups]
    state.schedules = [base_lr_schedule if g.get("name") == "base" else lr_schedule
                       for g in opt.param_groups]
    if state.epochs is None:
        state.epochs, plan = default_epochs(
            batches_per_epoch=state.steps_per_epoch, grad_accum_steps=state.grad_accum_steps,
            n_train=n_train, step=state.family, min_steps=min_steps)
        if ctx.is_main:
            logger.info("%s", plan)
    state.noise_generator = torch.Generator(device=ctx.device)
    state.noise_generator.manual_seed(rank_seed(seed, ctx.rank))
    if state.channels_last:
        bnn.model.to(memory_format=torch.channels_last)
    options = {
        "lr": lr, "base_lr": base_lr, "kl_anneal_epochs": state.kl_anneal_epochs,
        "beta": state.beta_max, "lr_schedule": lr_schedule, "base_lr_schedule": base_lr_schedule,
        "optimizer": optimizer, "momentum": momentum, "weight_decay": weight_decay,
        "base_weight_decay": base_weight_decay, "n_train": n_train, "seed": seed,
        "global_batch_size": state.data.global_batch_size,
        "grad_accum_steps": state.grad_accum_steps, "clip_grad_norm": state.clip_grad_norm,
    }
    return json.loads(json.dumps(options))


def _small_batch_lr(state: TrainContext, lr: float, *, n_train: int, optimizer: str) -> float:
    """The family's default ``lr`` for this run's optimiser batch (:func:`small_batch_factor`):
    examples per optimiser step = global batch × accumulation, or N_train / batches per
    epoch × accumulation for a loader without a ``batch_size`` (every rank runs that many
    batches and together they cover the N_train examples: that quotient is the global batch)."""
    accum = max(state.grad_accum_steps, 1)
    batch = state.data.global_batch_size
    if batch is not None:
        per_step: float | None = batch * accum
    elif state.steps_per_epoch > 0 and n_train > 0:
        per_step = n_train * accum / state.steps_per_epoch
    else:
        per_step = None
    factor = small_batch_factor(examples_per_step=per_step, optimizer=optimizer)
    if factor < 1.0 and state.ctx.is_main:
        logger.info("fit: %g examples per optimiser step, below the %d the default learning "
                    "rate assumes: lr %g → %g (%s scaling; lr= sets it)", per_step,
                    REFERENCE_BATCH, lr, lr * factor,
                    "linear" if optimizer == "sgd" else "square-root")
    return lr * factor


def _forward(state: TrainContext, *, compile: bool | dict[str, Any],
             find_unused_parameters: bool) -> None:
    """The module the gradient step calls: the step's terms, through DDP and compile."""
    # compiled: the noise comes from the global RNG, seeded per call from the generator
    # (a Generator object inside the graph breaks it at every wrapped layer); the same
    # under gradient checkpointing, which replays the global RNG when it recomputes a
    # segment in the backward pass, and not a Generator's draws
    checkpointing = gradient_checkpointing(state.bnn.model)
    if checkpointing and not compile:
        logger.info("fit: the model recomputes its forward in the backward pass (gradient "
                    "checkpointing): the noise is drawn from the global RNG, seeded per step "
                    "from the fit's generator, so the recomputed layers draw what the forward did")
    seeded = bool(compile) or checkpointing
    state.forward = TrainForward(state.bnn, None if seeded else state.noise_generator,
                                 state.family)
    if state.ctx.distributed:
        state.ddp = _wrap_ddp(state.forward, state.ctx, sync_buffers=state.bnn.bn_train,
                              find_unused_parameters=find_unused_parameters)
        state.forward = state.ddp
    if compile:
        compiled = torch.compile(state.forward, **(compile if isinstance(compile, dict) else {}))
        state.forward = SeededCompiledForward(compiled, state.noise_generator, state.ctx.device)
    elif checkpointing:
        state.forward = SeededCompiledForward(state.forward, state.noise_generator,
                                              state.ctx.device)


def gradient_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` has gradient checkpointing on the way Hugging Face and timm models
    say so (``model.gradient_checkpointing_enable()``: a ``gradient_checkpointing`` flag on
    the checkpointed stacks; timm's ``set_grad_checkpointing()``: ``grad_checkpointing``).
    Checkpointing of the user's own (``torch.utils.checkpoint`` in a forward) is found only
    when it recomputes: :attr:`bayesify.core.context.SamplingContext.plan` then refuses a
    generator's noise."""
    return any(getattr(m, flag, False) is True for m in model.modules()
               for flag in ("gradient_checkpointing", "grad_checkpointing"))


def _wrap_ddp(module: nn.Module, ctx: DistContext, *, sync_buffers: bool,
              find_unused_parameters: bool) -> nn.Module:
    """``DistributedDataParallel`` over the trainable tensors of ``module``.

    Tensors with ``requires_grad=False`` (the frozen base) are not registered with
    DDP's reducer, so they are never all-reduced. Buffers (BatchNorm statistics)
    are synchronised every forward only when BatchNorm trains (``bn_train``);
    frozen statistics are identical on every rank after DDP's initial broadcast.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    kwargs: dict[str, Any] = {"find_unused_parameters": find_unused_parameters}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        kwargs["forward_sync_buffers"] = sync_buffers
    else:
        kwargs["broadcast_buffers"] = sync_buffers
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, **kwargs)


def _run_epoch(state: TrainContext, *, progress: bool, run: ckpt.Run,
               hooks: list[Callback], watch: FitWatch) -> dict[str, Any]:
    """One epoch of the family's step over this rank's batches; the epoch's record."""
    bnn, step = state.bnn, state.family
    assert step is not None and state.data is not None
    bnn.train(step.optimizes)
    state.data.set_epoch(state.epoch, start_batch=state.step)
    state.logged = {}
    totals = state.totals or {"loss": 0.0, "nll": 0.0, "kl": 0.0, "count": 0.0, "images": 0.0,
                              "batches": 0.0, "seconds": 0.0}
    state.totals = totals
    start = time.perf_counter() - totals["seconds"]
    bar = progress_bar(None, f"epoch {state.epoch + 1}/{state.epochs}", enabled=progress,
                       total=state.steps_per_epoch or None, initial=state.step)
    beta, micro = 0.0, 0
    for batch in state.train_batches():
        if state.num_classes is None:  # the first batch: the class count is the logits'
            state.num_classes = _num_classes(bnn, batch)
        labels = batch.require_labels("fit")
        if labels.device.type == "cpu" or state.step == 0:  # no device sync on every step
            check_labels(labels, state.num_classes, where="fit")
        check_finite_batch(batch, where=f"fit at epoch {state.epoch}, step {state.step}",
                           error=NonFiniteLossError)  # before the forward touches BN statistics
        if state.epoch == 0:
            watch.see(batch)
        done = state.step
        terms = step.step(batch, state)
        if state.step == done:  # a step that took no gradient step: the driver counts
            state.step += 1
        micro += 1
        totals["images"] += batch.size
        totals["batches"] += 1
        bar.update(1)
        if terms is None:
            continue
        beta = terms["beta"]
        _add_terms(totals, terms, micro)
        micro = 0
        bar.set_postfix(loss=f"{terms['loss']:.4f}", nll=f"{terms['nll']:.4f}",
                        kl=f"{terms['kl']:.1f}", beta=f"{beta:.2f}")
        mid_epoch = state.steps_per_epoch <= 0 or state.step < state.steps_per_epoch
        if (run.directory is not None and run.every_steps(state) and mid_epoch):
            totals["seconds"] = time.perf_counter() - start
            ckpt.save(state, run)
        for hook in hooks:
            hook.on_step_end(state, terms)
    if state.optimizer is not None:
        flushed = flush_group(state, beta)
        if flushed is not None:
            _add_terms(totals, flushed, micro)
    bar.close()
    return _epoch_record(state, totals, beta, seconds=time.perf_counter() - start)


def _add_terms(totals: dict[str, float], terms: dict[str, float], micro: int) -> None:
    for k in ("loss", "nll", "kl"):
        totals[k] += terms[k] * micro
    totals["count"] += micro


def _epoch_record(state: TrainContext, totals: dict[str, float], beta: float, *,
                  seconds: float) -> dict[str, Any]:
    if totals["batches"] == 0 and state.optimizer is not None:
        raise BayesifyError(
            "the training loader produced no batches"
            + (f" on rank {state.ctx.rank} of {state.ctx.world_size}: the global batch "
               "(batch_size × world size) may exceed the data set" if state.ctx.distributed else "")
        )
    images = all_reduce_sum(torch.tensor([totals["images"]], dtype=torch.float64),
                            state.ctx).item()
    if images == 0:  # a statistics pass: a rank's shard may be empty, not every rank's
        raise BayesifyError("the training loader produced no batches")
    record: dict[str, Any] = {}
    if state.optimizer is not None:
        count = max(totals["count"], 1.0)
        record = {k: totals[k] / count for k in ("loss", "nll", "kl")}
    record.update({"epoch": state.epoch + 1, "steps": int(totals["batches"])})
    if state.optimizer is not None:
        record.update({"beta": beta, "lr": state.optimizer.param_groups[0]["lr"]})
    else:
        record["examples"] = int(images)
    record.update({"seconds": seconds, "images_per_second": images / max(seconds, 1e-9),
                   "world_size": state.ctx.world_size})
    if state.optimizer is not None:
        for group in state.optimizer.param_groups[1:]:
            record[f"lr_{group.get('name', 'group')}"] = group["lr"]
    record.update(state.logged)
    return record


def _refuse_half_precision(bnn: BayesianModel) -> None:
    """A posterior is fitted in float32 (or float64) weights: a network in float16 /
    bfloat16 failed in the families' first forward with torch's dtype errors (their
    posteriors built in float32 beside it), or trained σ's whose steps bf16 rounds away."""
    half = sorted({str(p.dtype).removeprefix("torch.") for p in bnn.parameters()
                   if p.dtype in (torch.float16, torch.bfloat16)})
    if half:
        raise BayesifyError(
            f"fit: the model has {' and '.join(half)} parameters; a posterior is fitted in "
            "float32 (or float64) weights, whose small standard deviations half precision "
            "rounds away. Call bnn.float() (or bayesify(model.float(), ...)) first; "
            "fit(amp=True) still runs the forward in bfloat16 autocast on a GPU")


@torch.no_grad()
def _num_classes(bnn: BayesianModel, batch: Any) -> int:
    """Classes of the model's output, from the first rows of a batch in eval mode (and
    whether the Laplace heads' classifier gives that output: :func:`laplace_heads.settle`)."""
    was_training = bnn.training
    bnn.eval()
    try:
        with bnn.deterministic():
            inputs = batch.rows(slice(0, 4)).model_input()
            try:
                with laplace_heads.watching_classifier(bnn) as seen:
                    logits = logits_of(call_model(bnn.model, inputs))
            except Exception:  # a shape mistake is named with the layer and the user's shape
                explain_shapes(bnn.model, lambda: call_model(bnn.model, inputs),
                               inputs=batch.model_input(), where="fit")
                raise
            check_not_probabilities(logits, where="fit")
            laplace_heads.settle(bnn, seen, logits)  # the heads' classifier gives the logits
            return int(logits.shape[-1])
    finally:
        bnn.train(was_training)


def _dataset_size(loader: Iterable, batch_fn: BatchFn | None = None) -> int:
    return training_set_size(loader, batch_fn=batch_fn)

