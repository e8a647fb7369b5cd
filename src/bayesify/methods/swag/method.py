"""SWAG family: SGD from the pretrained weights, moments collection, sampled networks.

The one epoch driver runs :class:`~bayesify.methods.swag.step.SWAGStep`: SGD on each
wrapped layer's working copy ``theta`` (the base weights never change), a snapshot
every k steps (or fraction of an epoch) into each layer's :class:`SWAGMoments`; at the
end ``theta`` is the running mean θ̄ (so ``bnn(x)`` is the SWA network) and the
BatchNorm statistics of θ̄ and of the default predictor's N members are in
:class:`SWAGBatchNorm` buffers. The covariance scale is the family's knob, chosen on
the validation split when one is given. Prediction draws N networks from the
member seeds and evaluates them with ``torch.func.functional_call`` in vmapped
chunks. Everything a predictor needs is a buffer or parameter: saved generically.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call, vmap

from bayesify.core.batch import Batch, batch_rows, call_model, model_ready
from bayesify.core.context import SamplingContext
from bayesify.core.fitting import Knob, Step
from bayesify.core.method import Method
from bayesify.core.outputs import logits_of
from bayesify.core.selection import log_grid
from bayesify.errors import BayesifyError
from bayesify.kit.family import add_modules
from bayesify.methods.swag import state
from bayesify.methods.swag.config import SWAGConfig
from bayesify.methods.swag.export import export_swag
from bayesify.methods.swag.layers import SWAGLayer, swag_batchnorm_wrappers
from bayesify.methods.swag.step import SWAGStep, tunes_scale

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

_VMAP_OK = "swag_vmap_ok"
_NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented the batching rule"


class SWAGMethod(Method):
    """SWA / SWAG-diagonal / SWAG around the pretrained weights (SGD snapshots)."""

    name = "swag"
    config_cls = SWAGConfig
    wrappers: ClassVar = {
        nn.Linear: SWAGLayer,
        nn.Conv1d: SWAGLayer,
        nn.Conv2d: SWAGLayer,
        nn.Conv3d: SWAGLayer,
        nn.ConvTranspose1d: SWAGLayer,
        nn.ConvTranspose2d: SWAGLayer,
        nn.ConvTranspose3d: SWAGLayer,
    }

    # -- structure, state and training ------------------------------------------------
    def build(self, model: nn.Module, targets: list[str],
              context: SamplingContext) -> dict[str, nn.Module]:
        """The target wrappers, plus one :class:`SWAGBatchNorm` per BatchNorm: BatchNorm
        statistics belong to the posterior."""
        extra = dict(swag_batchnorm_wrappers(model, context, self.config.predict_samples, targets))
        return add_modules(super().build(model, targets, context), extra, family=self.name)

    def prepare(self, bnn: BayesianModel) -> None:
        bnn.state.add("swag_scale", torch.tensor(self.config.sample_scale, dtype=torch.float64))
        bnn.state.add("swag_period", torch.zeros((), dtype=torch.long))
        #: whether member_mean/var of the BatchNorm wrappers hold the seed-0 members
        bnn.state.add("swag_bn_members", torch.zeros((), dtype=torch.long))
        #: 1 once fit finished: until then the predictive is the current iterate θ
        bnn.state.add("swag_fitted", torch.zeros((), dtype=torch.long))

    def step(self) -> Step:
        return SWAGStep(self.config)

    def knobs(self, bnn: BayesianModel) -> list[Knob]:
        """The covariance scale on ``scale_grid`` by validation NLL (the broadest scale within
        the rule); the stored BatchNorm statistics follow the chosen scale."""
        cfg: SWAGConfig = self.config
        if not tunes_scale(cfg) or not state.fitted(bnn):
            return []

        def settle() -> dict[str, Any]:
            state.store_batchnorm(bnn, cfg)
            return {"scale": state.scale(bnn)}

        return [Knob(name="swag_scale", grid=tuple(log_grid(cfg.scale_grid)),
                     meaning="covariance scale of the sampled networks; larger is broader",
                     set=lambda value: state.install_scale(bnn, cfg, value), prefer="largest",
                     rule=cfg.val_rule, settle=settle)]

    def scale(self, bnn: BayesianModel) -> float:
        """The covariance scale of the samples."""
        return state.scale(bnn)

    def sample(self, bnn: BayesianModel, member: int, seed: int | None = 0) -> dict[str, torch.Tensor]:
        """Sampled parameters of predictive member ``member`` (reproducible from ``seed``)."""
        return state.sample(bnn, self.config, member, seed)

    def member_batchnorm(self, bnn: BayesianModel, num_members: int,
                         seed: int | None) -> list[dict[str, torch.Tensor]]:
        """BatchNorm statistics of every sampled member (recomputed once, then cached)."""
        return state.member_batchnorm(bnn, self.config, num_members, seed)

    # -- prediction ----------------------------------------------------------------------
    def member_logits(
        self,
        bnn: BayesianModel,
        x: torch.Tensor,
        *,
        samples_per_component: int,
        max_rows: int,
        seed: int | None = None,
        deterministic: bool = False,
    ) -> torch.Tensor:
        """``[M, B, C]``: M = N sampled networks (1 for 'swa' or ``deterministic``: θ̄)."""
        if deterministic or self.config.variant == "swa" or not state.fitted(bnn):
            return logits_of(call_model(bnn.model, x)).unsqueeze(0)
        num = samples_per_component
        bn_stats = self.member_batchnorm(bnn, num, seed)
        per_param = max(1, 2**27 // max(1, sum(layer.num_nodes() for layer in state.layers(bnn).values())))
        per_chunk = max(1, min(max_rows // max(batch_rows(x), 1), per_param))
        outs = []
        for start in range(0, num, per_chunk):
            ids = range(start, min(start + per_chunk, num))
            states = [{**self.sample(bnn, m, seed), **bn_stats[m]} for m in ids]
            outs.append(_evaluate(bnn, states, x, vectorize=self.config.vectorize))
        return torch.cat(outs, dim=0)

    def heads_features(self, bnn: BayesianModel, x: Any, *, samples_per_component: int,
                       seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(φ [M, B, D], f [M, B, C])`` of the sampled networks for member-wise Laplace heads:
        one ``functional_call`` per member with a hook on the classifier (the vmapped
        members of :meth:`member_logits` hide their batched features from a hook)."""
        from bayesify.kit.laplace_heads import classifier_calls, joint_rows

        if self.config.variant == "swa" or not state.fitted(bnn):
            states = [{}]
        else:
            bn_stats = self.member_batchnorm(bnn, samples_per_component, seed)
            states = [{**self.sample(bnn, m, seed), **bn_stats[m]}
                      for m in range(samples_per_component)]
        seen, outs = [], []
        for member in states:  # one by one: the hooks see each
            with classifier_calls(bnn) as calls:
                logits = _evaluate(bnn, [member], x, vectorize=False)[0]
            # a decoder's gathered token, a distilled model's heads: the rows of the logits
            feats = joint_rows(calls, logits)[0] if all(len(c) == 1 for c in calls) else None
            if feats is None or feats.dim() != 2:
                raise BayesifyError(
                    "laplace_heads needs SWAG's classifier (a Linear on [B, D] features) to run "
                    f"once per sampled network; it ran {[len(c) for c in calls]} times; use "
                    "laplace_heads=False")
            seen.append(feats)
            outs.append(logits)
        return torch.stack(seen), torch.stack(outs)

    def export_module(self, bnn: BayesianModel, *, samples_per_component: int, seed: int,
                      example_input: Any) -> nn.Module:
        """``x → [N, B, C]``: the N sampled networks (weights + recomputed BatchNorm) as
        plain copies; see :mod:`bayesify.methods.swag.export`."""
        cfg: SWAGConfig = self.config
        if bnn.context.force_deterministic or cfg.variant == "swa" or not state.fitted(bnn):
            return export_swag(bnn, [state.mean_network(bnn)])  # θ̄ with its BatchNorm
        bn_stats = self.member_batchnorm(bnn, samples_per_component, seed)
        return export_swag(bnn, [{**self.sample(bnn, m, seed), **bn_stats[m]}
                                 for m in range(samples_per_component)])


def _evaluate(bnn: BayesianModel, states: list[dict[str, torch.Tensor]], x: Any, *,
              vectorize: bool) -> torch.Tensor:
    """``[m, B, C]`` logits of m networks given as functional_call state dicts (vmapped
    while the model allows it: a model that cannot be vmapped is remembered in
    ``bnn.runtime``)."""
    model = bnn.model
    args, kwargs = (x.args, x.kwargs) if isinstance(x, Batch) else ((x,), {})
    args, kwargs = model_ready(model, args, kwargs)  # floating inputs in the network's dtype
    if bnn.runtime.get(_VMAP_OK, vectorize) and len(states) > 1:
        stacked = {k: torch.stack([s[k] for s in states]) for k in states[0]}
        try:
            with warnings.catch_warnings():
                # torch's note that an op (adaptive pooling, stochastic depth) has no batching
                # rule and runs as a loop inside vmap: correct, slower, and not the user's to
                # file ("Please file us an issue")
                warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE)
                return vmap(lambda s: logits_of(functional_call(model, s, args, kwargs)))(stacked)
        except Exception as err:  # noqa: BLE001 - arbitrary user models may not vmap
            warnings.warn(f"SWAG: vmap over sampled networks failed ({err}); "
                          "evaluating them one by one", stacklevel=3)
            bnn.runtime[_VMAP_OK] = False
    return torch.stack([logits_of(functional_call(model, s, args, kwargs)) for s in states])
