"""``BayesianModel``: the bayesified network and everything that hangs off it."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.context import SamplingContext
from bayesify.core.layers import BayesianLayer
from bayesify.core.method import Method, logits_of

if TYPE_CHECKING:
    from bayesify.predict.predictor import EnsemblePredictor

_BN_TYPES = (nn.modules.batchnorm._BatchNorm,)


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
    ) -> None:
        super().__init__()
        self.model = model
        self.method = method
        self.context = context
        self.targets = list(targets)
        self.skipped = dict(skipped or {})
        self._base_requires_grad = dict(base_requires_grad)
        self.bn_train = False

    # -- structure -------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.method.config

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
                if not pname.startswith("base_layer."):
                    yield f"{name}.{pname}", p
        yield from self.method.extra_posterior_parameters(self)

    def posterior_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_posterior_parameters()]

    def named_base_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        posterior = {id(p) for p in self.posterior_parameters()}
        for name, p in self.model.named_parameters():
            if id(p) not in posterior:
                yield name.replace(".base_layer.", "."), p

    def base_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_base_parameters()]

    def set_base_trainable(self, trainable: bool) -> None:
        for p in self.base_parameters():
            p.requires_grad_(trainable)

    def num_nodes(self) -> int:
        """Noise variables per component, summed over injected layers."""
        return sum(layer.num_nodes() for layer in self.bayesian_layers().values())

    def kl(self) -> torch.Tensor:
        """KL(q‖p) of the whole posterior, summed over layers (not divided by N)."""
        return self.method.kl(self)

    # -- modes -------------------------------------------------------------------------
    def train(self, mode: bool = True) -> BayesianModel:
        super().train(mode)
        if mode and not self.bn_train:
            # frozen pretrained statistics: BatchNorm stays in eval while fine-tuning
            for m in self.model.modules():
                if isinstance(m, _BN_TYPES):
                    m.eval()
        return self

    @contextlib.contextmanager
    def deterministic(self) -> Iterator[BayesianModel]:
        """Every noise variable replaced by the posterior mean of its component."""
        previous = self.context.force_deterministic
        self.context.force_deterministic = True
        try:
            yield self
        finally:
            self.context.force_deterministic = previous

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Forward of the wrapped model under the current sampling plan.

        Without an active plan rows are dealt to components round-robin and noise
        is sampled (inside :meth:`deterministic`: posterior means).
        """
        return self.model(x, *args, **kwargs)

    def training_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiled logits ``[R, C]`` and targets ``[R]`` for one training batch."""
        return self.method.training_forward(self, x, y)

    def member_logits(
        self,
        x: torch.Tensor,
        *,
        samples_per_component: int | None = None,
        max_rows: int = 4096,
        seed: int | None = 0,
    ) -> torch.Tensor:
        """``[M, B, C]`` logits of every predictive member (M fixed networks per seed)."""
        n = samples_per_component or self.method.default_samples_per_component()
        return self.method.member_logits(
            self, x, samples_per_component=n, max_rows=max_rows, seed=seed,
            deterministic=self.context.force_deterministic,
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model(x))

    def predictor(self, samples_per_component: int | None = None, **kwargs: Any) -> EnsemblePredictor:
        """An :class:`EnsemblePredictor` over K components × n samples."""
        from bayesify.predict.predictor import EnsemblePredictor

        return EnsemblePredictor(self, samples_per_component=samples_per_component, **kwargs)

    def save_posterior(self, directory: Any) -> Any:
        """Write ``posterior.safetensors`` + ``bayesify.json``; see ``bayesify.persistence``."""
        from bayesify.persistence import save_posterior

        return save_posterior(self, directory)

    # -- undo / describe -----------------------------------------------------------------
    def unwrap(self) -> nn.Module:
        """A copy of the base network with every wrapper replaced by its ``base_layer``.

        Its ``state_dict`` equals the original's bit for bit (unless base weights
        were fine-tuned); ``requires_grad`` flags are restored.
        """
        model = copy.deepcopy(self.model)
        for name, module in list(model.named_modules()):
            if isinstance(module, BayesianLayer):
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, module.base_layer)
        restore = getattr(self.method, "restore_unwrapped", None)
        if restore is not None:
            restore(self, model)
        for name, p in model.named_parameters():
            p.requires_grad_(self._base_requires_grad.get(name, True))
        return model

    def summary(self) -> str:
        """A table of injected layers and posterior sizes."""
        rows = [("layer", "type", "nodes", "posterior values")]
        for name, layer in self.bayesian_layers().items():
            size = sum(p.numel() for p in layer.posterior_parameters())
            rows.append((name, type(layer.base_layer).__name__, str(layer.num_nodes()), str(size)))
        total = sum(p.numel() for p in self.posterior_parameters())
        base = sum(p.numel() for p in self.base_parameters())
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        title = (f"bayesify[{self.method_name}] {type(self.model).__name__}: "
                 f"{len(rows) - 1} layer(s) wrapped, components={self.method.components}")
        lines = [title]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        lines.append(f"nodes per component: {self.num_nodes()}; posterior values: {total}; "
                     f"base parameters: {base}")
        if self.skipped:
            lines.append(f"skipped: {self.skipped}")
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return (f"method={self.method_name}, components={self.method.components}, "
                f"wrapped={len(self.targets)}")
