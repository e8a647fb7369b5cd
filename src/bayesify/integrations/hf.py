"""A Hugging Face ``transformers.Trainer`` for bayesified models.

::

    from bayesify.integrations.hf import BayesTrainer

    bnn = bayesify(AutoModelForSequenceClassification.from_pretrained(...), method="ibnn")
    trainer = BayesTrainer(model=bnn, args=TrainingArguments(...),
                           train_dataset=train_set, eval_dataset=val_set)
    trainer.train()             # ELBO steps at the family's posterior LR; then the validation search
    trainer.evaluate()          # eval_loss = NLL of the posterior predictive (all members)
    predictor = bnn.predictor()

What it changes against a plain ``Trainer`` (each is what the plain one gets wrong
on a :class:`~bayesify.core.model.BayesianModel`):

- **loss**: :func:`bayesify.elbo_loss` (mean NLL over the family's tiled batch +
  KL / N_train), ``N_train = len(train_dataset)`` unless ``n_train=`` is given;
- **optimiser**: :func:`bayesify.posterior_optimizer`, i.e. the family's posterior
  LR and optimiser (ibnn: SGD Nesterov at 0.2). ``args.learning_rate`` (5e-5 by
  default, a full fine-tuning step) is not used for the posterior, it would leave
  it where it started; ``posterior_lr=`` overrides the family's, ``base_lr=`` > 0
  also trains the base weights. Below 16 examples per optimiser step (batch × devices ×
  accumulation) the family's LR is scaled down as ``fit`` scales it.
  ``args.lr_scheduler_type`` still applies;
- **evaluation**: ``eval_loss`` is the NLL of the posterior predictive (the
  mixture over ``bnn.predictor()``'s members) and the "logits" handed to
  ``compute_metrics`` are its log-probabilities ``[N, C]``;
- **validation search**: after ``train()`` the family's predictive-scale knob is
  chosen on ``eval_dataset`` (:func:`bayesify.tune`, as ``fit(..., val_loader=...)``
  does) unless ``tune_after_train=False``; the record is ``trainer.tune_record``. The
  state training began from is taken before the first step
  (:func:`bayesify.train.best.starting_state`), and a family with member-wise Laplace
  heads hands that start back with its heads where the trained state does worse under the
  validation shift or is not feasible (``tune_record["kept"]``), as ``fit`` does — not
  when training resumes from a checkpoint (``resume_from_checkpoint``: the start is not
  the network's);
- **inputs**: columns are kept or dropped by the *wrapped* model's ``forward``
  signature and labels are read from ``labels`` (``BayesianModel.forward`` takes
  ``*args, **kwargs``, which would otherwise drop every column and find no labels);
- **divergence**: a non-finite ELBO raises :class:`~bayesify.errors.NonFiniteLossError`
  (from :func:`bayesify.elbo_loss`) naming the family and what to do, never a silent NaN;
  ``args.max_grad_norm`` (1 by default) clips as ``fit`` does for the multiplicative
  families. A loop of your own gets ``fit``'s recovering guard from
  :class:`bayesify.GuardedStep`;
- **saving**: ``save_model`` also writes the posterior (``posterior.safetensors`` +
  ``bayesify.json``), so ``bayesify.load_posterior(base_model, output_dir)`` works.

Single process (CPU or one GPU). For data parallel training use ``bayesify.fit``
under ``torchrun``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers

from bayesify.core.model import BayesianModel
from bayesify.errors import BayesifyError
from bayesify.kit import laplace_heads
from bayesify.train.best import starting_state
from bayesify.train.custom_loop import posterior_optimizer
from bayesify.train.data import whole_batches
from bayesify.train.loss import elbo_loss
from bayesify.train.tuning import tune


class BayesTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose model is a ``BayesianModel`` (see the module docstring)."""

    def __init__(self, model: BayesianModel | None = None, args: Any = None, *,
                 n_train: int | None = None, posterior_lr: float | None = None,
                 base_lr: float = 0.0, samples_per_component: int | None = None,
                 tune_after_train: bool = True, **kwargs: Any) -> None:
        if not isinstance(model, BayesianModel):
            raise BayesifyError("BayesTrainer needs model=bayesify(your_model, method=...), got "
                                f"{type(model).__name__}")
        super().__init__(model=model, args=args, **kwargs)
        self.n_train = n_train
        self.posterior_lr, self.base_lr = posterior_lr, base_lr
        self.samples_per_component = samples_per_component
        self.tune_after_train = tune_after_train
        self.tune_record: dict[str, Any] = {}
        #: the state ``train()`` began from (weighed with its heads by ``tune``)
        self.start_state: dict[str, torch.Tensor] | None = None
        if self.args.label_names is None:
            self.label_names = ["labels"]
        self.model_accepts_loss_kwargs = False  # the loss is elbo_loss, not the model's
        self.can_return_loss = False

    # -- what the plain Trainer reads from the model's forward signature ------------------
    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            forward = inspect.signature(self._bnn.model.forward).parameters
            self._signature_columns = list(forward) + sorted(
                {"label", "label_ids", *self.label_names})

    @property
    def _bnn(self) -> BayesianModel:
        return self.accelerator.unwrap_model(self.model)

    # -- optimiser and loss ---------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            args = self.args  # examples per optimiser step, as fit counts them
            per_step = (args.per_device_train_batch_size * max(args.world_size, 1)
                        * max(args.gradient_accumulation_steps, 1))
            self.optimizer = posterior_optimizer(self._bnn, lr=self.posterior_lr,
                                                 base_lr=self.base_lr, batch_size=per_step)
        return self.optimizer

    def _train_size(self) -> int:
        if self.n_train is not None:
            return int(self.n_train)
        try:
            return len(self.train_dataset)  # type: ignore[arg-type]
        except TypeError:
            raise BayesifyError("the training set has no len(); pass BayesTrainer(n_train=N), "
                                "the number of training examples") from None

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Training: the ELBO loss. Evaluation: NLL of the posterior predictive."""
        bnn = self._bnn
        if bnn.training:
            terms = elbo_loss(bnn, inputs, n_train=self._train_size())
            return (terms.loss, {"loss": terms.loss}) if return_outputs else terms.loss
        labels = inputs["labels"]
        features = {k: v for k, v in inputs.items() if k not in ("labels", "label")}
        pred = bnn.predictor(self.samples_per_component)(**features)
        log_probs = pred.log_probs
        loss = pred.nll(labels.to(log_probs.device)).mean()
        return (loss, {"loss": loss, "logits": log_probs}) if return_outputs else loss

    # -- after training: the family's validation search ---------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        tuning = self.tune_after_train and self.eval_dataset is not None
        resumed = bool(kwargs.get("resume_from_checkpoint") or (args and args[0]))
        if tuning and laplace_heads.enabled(self._bnn):
            # the heads' classifier gives the logits? (turned off, warned, where not: before
            # the training, not after it, when tune() would fit them)
            first = next(whole_batches(self.get_eval_dataloader(), device=self._bnn.device,
                                       batch_fn=None), None)
            if first is not None:
                laplace_heads.settle_on(self._bnn, first, caller="BayesTrainer")
        self.start_state = (starting_state(self._bnn)
                            if tuning and not resumed and laplace_heads.enabled(self._bnn)
                            else None)
        output = super().train(*args, **kwargs)
        if tuning:
            self.tune_record = self.tune()
        return output

    def tune(self, eval_dataset: Any = None) -> dict[str, Any]:
        """:func:`bayesify.tune` on ``eval_dataset`` (default: the trainer's), with the
        training set for the family's member-wise Laplace heads (``laplace_heads``) and the
        state ``train()`` began from (``start_state``); logs the choice."""
        train = self.get_train_dataloader() if self.train_dataset is not None else None
        record = tune(self._bnn, self.get_eval_dataloader(eval_dataset), train_loader=train,
                      start=self.start_state)
        self.log({k: v for k, v in record.items() if isinstance(v, (int, float))})
        return record

    # -- saving -------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:
            self._bnn.save_posterior(output_dir or self.args.output_dir)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        # the plain one reads model._keys_to_ignore_on_save, which only PreTrainedModel has
        if load_result.missing_keys or load_result.unexpected_keys:
            raise BayesifyError(f"checkpoint does not match the bayesified model: missing "
                                f"{load_result.missing_keys[:5]}, unexpected "
                                f"{load_result.unexpected_keys[:5]}")
