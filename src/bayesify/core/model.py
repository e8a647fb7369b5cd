"""``BayesianModel``: the bayesified network and everything that hangs off it."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core import layout
from bayesify.core.batch import call_with
from bayesify.core.context import SamplingContext
from bayesify.core.digests import fingerprint_from_digests, tensor_digest
from bayesify.core.extensions import implementation
from bayesify.core.layers import BayesianLayer
from bayesify.core.locks import model_lock
from bayesify.core.names import base_name, in_base_layer, posterior_name
from bayesify.core.outputs import logits_of
from bayesify.core.signature import forward_with_signature
from bayesify.core.state import PosteriorState, RuntimeCache, forget_derived_on_load
from bayesify.core.walker import replace_modules
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.method import Method

def _compiling() -> bool:
    """Whether ``torch.compile`` is tracing (without importing dynamo, ~4 s, when unused)."""
    return "torch._dynamo" in sys.modules and torch.compiler.is_compiling()


def _batched_kl(cls: type) -> bool:
    """Whether ``cls.kl_many`` computes Σ ``kl`` of its layers: the class that defines
    ``kl_many`` also defines the ``kl`` in effect (a subclass that overrides ``kl`` alone
    is summed layer by layer)."""
    owner_kl = next((c for c in cls.__mro__ if "kl" in vars(c)), None)
    owner_many = next((c for c in cls.__mro__ if "kl_many" in vars(c)), None)
    return owner_many is not None and owner_many is owner_kl


class BayesianModel(nn.Module):
    """A network with posteriors injected around its target layers.

    ``model`` is the (copied) base network whose target modules were replaced by
    :class:`BayesianLayer` wrappers; ``method`` is the family object holding the
    config. Names of posterior tensors are the base model's own module names.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        method: Method,
        context: SamplingContext,
        targets: list[str],
        base_requires_grad: dict[str, bool],
        skipped: dict[str, str] | None = None,
        base_digests: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.method = method
        self.context = context
        self.targets = list(targets)
        self.skipped = dict(skipped or {})
        self._base_requires_grad = dict(base_requires_grad)
        #: sha256 of every base ``state_dict`` tensor when the model was wrapped
        self.base_digests = dict(base_digests or {})
        self.state = PosteriorState()
        self.state.add("temperature", torch.ones((), dtype=torch.float64))
        #: who set ``state.temperature`` (a predictive-level temperature, softmax(log p̄ / T)):
        #: "default" (1), "search" (the validation knob × T search: ``calibrate`` then refuses
        #: to move it without ``force=True``) or "calibrate"; saved in the manifest
        self.temperature_source = "default"
        #: per-model caches and data sources of the family: never saved (see RuntimeCache)
        self.runtime = RuntimeCache()
        self.register_load_state_dict_post_hook(forget_derived_on_load)
        # finds where every wrapped layer's input keeps the batch, at the first planned forward
        layout.install(model, context)
        self.bn_train = False
        # inspect.signature(bnn.forward) is the wrapped model's (HF Trainer column pruning)
        bound = forward_with_signature(self, type(self).forward, model)
        if bound is not None:
            self.forward = bound

    # -- structure -------------------------------------------------------------------
    @property
    def posterior_config(self) -> Any:
        """The family's frozen config (also ``bnn.method.config``)."""
        return self.method.config

    @property
    def config(self) -> Any:
        """The wrapped network's own ``config`` (Hugging Face models), which libraries
        such as ``transformers.Trainer`` read and write; ``AttributeError`` without one."""
        return self.model.config

    # -- Hugging Face's activation (gradient) checkpointing of the wrapped model -------------
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        **kwargs: Any) -> None:
        """The wrapped Hugging Face model's checkpointing (what ``transformers.Trainer`` calls
        for ``TrainingArguments(gradient_checkpointing=True)``; before the thirty-fifth stop
        ``BayesTrainer`` failed there with an ``AttributeError``). Non-reentrant unless asked:
        the reentrant variant gives no gradient to the parameters inside a checkpointed block
        whose input needs none, and with the base frozen that is every posterior tensor there
        (transformers 4's default was reentrant). The recomputed layers read the sampling
        plan of the forward they recompute (:attr:`bayesify.core.context.SamplingContext.plan`)."""
        options = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=options, **kwargs)
        else:
            enable = getattr(self.model, "gradient_checkpointing_enable", None)
            if enable is None:
                raise BayesifyError(
                    f"{type(self.model).__name__} has no activation checkpointing to enable (a "
                    "Hugging Face model's activation_checkpointing_enable); call "
                    "torch.utils.checkpoint in its forward instead, or train without it")
            enable(gradient_checkpointing_kwargs=options, **kwargs)
        if options["use_reentrant"] and hasattr(self.model, "enable_input_require_grads"):
            self.model.enable_input_require_grads()  # else the checkpointed blocks get no gradient

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      **kwargs: Any) -> None:
        """:meth:`activation_checkpointing_enable` under its transformers-4 name."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        disable = (getattr(self.model, "activation_checkpointing_disable", None)
                   or getattr(self.model, "gradient_checkpointing_disable", None))
        if disable is not None:
            disable()

    gradient_checkpointing_disable = activation_checkpointing_disable

    @property
    def method_name(self) -> str:
        return self.method.name

    @property
    def device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def bayesian_layers(self) -> dict[str, BayesianLayer]:
        """Injected layers by the base model's qualified name."""
        return {n: m for n, m in self.model.named_modules() if isinstance(m, BayesianLayer)}

    def named_posterior_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(base-model module name + '.' + param, tensor)`` for every posterior tensor."""
        for name, layer in self.bayesian_layers().items():
            for pname, p in layer.named_parameters():
                if not in_base_layer(pname):
                    yield posterior_name(name, pname), p

    def posterior_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_posterior_parameters()]

    def named_posterior_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Non-trainable posterior state: buffers the injected layers add (keyed by the
        base model's module names) and family-level state (``bayesify.<name>``)."""
        for name, layer in self.bayesian_layers().items():
            for bname, b in layer.named_buffers():
                if not in_base_layer(bname):
                    yield posterior_name(name, bname), b
        for bname, b in self.state.named_buffers():
            yield f"bayesify.{bname}", b

    def posterior_tensors(self) -> dict[str, torch.Tensor]:
        """Everything the predictive needs beyond the base network, by name."""
        return {**dict(self.named_posterior_parameters()), **dict(self.named_posterior_buffers())}

    @property
    def base_fingerprint(self) -> str:
        """Fingerprint of the base weights as they were when the model was wrapped."""
        return fingerprint_from_digests(self.base_digests)

    def changed_base_tensors(self) -> dict[str, torch.Tensor]:
        """Base ``state_dict`` tensors that differ from the wrapped original (fine-tuned
        with ``base_lr > 0`` or BatchNorm trained): saved with the posterior, like PEFT's
        ``modules_to_save``."""
        changed = {}
        for name, tensor in self.base_state_dict().items():
            if self.base_digests.get(name) != tensor_digest(name, tensor):
                changed[name] = tensor
        return changed

    def base_state_dict(self) -> dict[str, torch.Tensor]:
        """The base network's ``state_dict`` under its original names (no wrappers)."""
        out = {}
        for name, layer in self.bayesian_layers().items():
            for key, value in layer.base_layer.state_dict(keep_vars=True).items():
                out[f"{name}.{key}"] = value
        inside = tuple(f"{n}." for n in self.bayesian_layers())
        for key, value in self.model.state_dict(keep_vars=True).items():
            if not key.startswith(inside):
                out[key] = value
        return {k: v.detach() for k, v in out.items()}

    def named_base_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        posterior = {id(p) for p in self.posterior_parameters()}
        for name, p in self.model.named_parameters():
            if id(p) not in posterior:
                yield base_name(name), p

    def base_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_base_parameters()]

    def set_base_trainable(self, trainable: bool) -> None:
        for p in self.base_parameters():
            p.requires_grad_(trainable)

    def num_nodes(self) -> int:
        """Noise variables per component, summed over injected layers."""
        return sum(layer.num_nodes() for layer in self.bayesian_layers().values())

    def kl(self) -> torch.Tensor:
        """KL(q‖p) of the whole posterior, summed over the injected layers (not divided
        by N_train; 0 for families without a variational term)."""
        total = torch.zeros((), device=self.device)
        batched: dict[type, list[BayesianLayer]] = {}
        for layer in self.bayesian_layers().values():
            if _batched_kl(type(layer)):
                batched.setdefault(type(layer), []).append(layer)
            else:
                total = total + layer.kl().to(total.device, torch.float32)
        for cls, layers in batched.items():  # one computation for every layer of a class
            total = total + cls.kl_many(layers).to(total.device, torch.float32)
        return total

    # -- modes -------------------------------------------------------------------------
    def train(self, mode: bool = True) -> BayesianModel:
        super().train(mode)
        if mode and not self.bn_train:
            # frozen pretrained state: every base module that owns buffers (BatchNorm
            # statistics, spectral_norm's u/v, ...) stays in eval while fine-tuning, so
            # fit never changes them; set bnn.bn_train = True to train them
            for m in self.model.modules():
                if not isinstance(m, BayesianLayer) and next(m.buffers(recurse=False), None) is not None:
                    m.eval()
        return self

    @contextlib.contextmanager
    def deterministic(self) -> Iterator[BayesianModel]:
        """Every noise variable replaced by the posterior mean of its component.

        The mode is the model's (every layer reads it), so the block holds the model's
        lock (:func:`~bayesify.core.locks.model_lock`, re-entrant): predictions of other
        threads wait for it instead of seeing posterior means mid-call, and calls in
        this thread inside the block run as usual.
        """
        with model_lock(self):
            previous = self.context.force_deterministic
            self.context.force_deterministic = True
            try:
                yield self
            finally:
                self.context.force_deterministic = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward of the wrapped model under the current sampling plan.

        Without an active plan rows are dealt to components round-robin and noise
        is sampled (inside :meth:`deterministic`: posterior means).
        """
        # inputs in the model's dtype, uint8 images refused (bayesify.core.batch.model_ready)
        if _compiling():  # traced: no Python lock in the graph
            self.context.new_pass()
            return call_with(self.model, args, kwargs)
        with model_lock(self):  # the sampling plan is shared: one forward at a time
            self.context.new_pass()
            return call_with(self.model, args, kwargs)

    def training_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiled logits ``[R, C]`` and targets ``[R]`` for one training batch (the batch
        layout of the family's step)."""
        return self.method.step().forward(self, x, y)

    def member_logits(
        self,
        x: torch.Tensor,
        *,
        samples_per_component: int | None = None,
        max_rows: int = 4096,
        seed: int | None = 0,
    ) -> torch.Tensor:
        """``[M, B, C]`` logits of every predictive member (M fixed networks per seed)."""
        n = samples_per_component or self.posterior_config.default_samples()
        with model_lock(self):  # the sampling plan is shared: one prediction at a time
            return self.method.member_logits(
                self, x, samples_per_component=n, max_rows=max_rows, seed=seed,
                deterministic=self.context.force_deterministic,
            )

    def predictive(self, x: Any, *, samples_per_component: int | None = None,
                   max_rows: int = 4096, seed: int | None = 0) -> Any:
        """The raw :class:`~bayesify.core.prediction.Prediction` (members or moments)."""
        n = samples_per_component or self.posterior_config.default_samples()
        with model_lock(self):  # the sampling plan is shared: one prediction at a time
            if getattr(self.posterior_config, "laplace_heads", False):  # bayesify.kit.laplace_heads
                heads = implementation("laplace_heads")(
                    self, x, samples_per_component=n, max_rows=max_rows, seed=seed,
                    deterministic=self.context.force_deterministic)
                if heads is not None:
                    return heads
            return self.method.predictive(
                self, x, samples_per_component=n, max_rows=max_rows, seed=seed,
                deterministic=self.context.force_deterministic,
            )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model(x))

    def predictor(self, samples_per_component: int | None = None, **kwargs: Any) -> Any:
        """An ``EnsemblePredictor`` over K components × n samples (implemented by
        :mod:`bayesify.predict`, registered through :mod:`bayesify.core.extensions`)."""
        return implementation("predictor")(self, samples_per_component=samples_per_component,
                                           **kwargs)

    def save_posterior(self, directory: Any, *, key: str | bytes | None = None) -> Any:
        """Write ``posterior.safetensors`` + ``bayesify.json``; see ``bayesify.persistence``
        (``key``: sign the manifest with HMAC-SHA256)."""
        return implementation("save_posterior")(self, directory, key=key)

    # -- undo / describe -----------------------------------------------------------------
    def unwrap(self) -> nn.Module:
        """A copy of the base network with every wrapper replaced by its ``base_layer``.

        Its ``state_dict`` equals the original's bit for bit (unless base weights
        were fine-tuned); ``requires_grad`` flags are restored.
        """
        model = copy.deepcopy(self.model)
        replace_modules(model, {name: module.base_layer for name, module in model.named_modules()
                                if isinstance(module, BayesianLayer)})
        for name, p in model.named_parameters():
            p.requires_grad_(self._base_requires_grad.get(name, True))
        return model

    def summary(self) -> str:
        """A table of injected layers, their random variables and posterior sizes."""
        from bayesify.core.summary import summarize

        return summarize(self)

    def extra_repr(self) -> str:
        return (f"method={self.method_name}, components={self.method.components}, "
                f"wrapped={len(self.targets)}")
