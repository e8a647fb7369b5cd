"""Tensor plumbing shared by the weight-space families (meanfield, hypernet).

* :func:`apply_layer` runs a Linear/Conv with *given* weight and bias tensors
  (honouring stride, padding, padding mode, dilation and groups of the module),
  so a layer can use sampled weights without touching the module's own; a subclass
  with its own ``forward`` (:func:`has_own_forward`: weight-standardised or
  same-padded convolutions) runs that forward on the given tensors.
* :func:`member_rows` reads the sampling plan: which members are present in
  this batch and which member every row belongs to.
* :func:`member_normal` draws one noise vector per member: seeded per
  ``(seed, stream)`` at prediction (member ``m`` is the same network on every
  call and in every chunk), from the plan's generator in training.
* :func:`batched_apply` evaluates ``k`` weight samples on their own rows in
  one call (``torch.vmap`` over :func:`apply_layer`, i.e. a grouped
  convolution / batched matmul) — no Python loop per row or per member when
  the rows are laid out member-major, as ``tile`` lays them out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bayesify.core.batch import batch_device, batch_rows, call_model, tile
from bayesify.core.context import SamplingContext, expand_plan_rows
from bayesify.core.outputs import logits_of
from bayesify.errors import BayesifyError

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _explicit_padding(module: nn.modules.conv._ConvNd) -> tuple[int, ...]:
    """Per-dimension padding of a conv whose ``padding`` may be 'same'/'valid'."""
    if module.padding == "valid":
        return (0,) * len(module.kernel_size)
    if module.padding == "same":
        raise BayesifyError(
            f"padding='same' with padding_mode={module.padding_mode!r} is not supported by "
            "the weight-space families; exclude this layer with exclude=[...]"
        )
    return tuple(module.padding)


#: Linear/Conv subclasses whose own ``forward`` is the plain operation (timm's ``Linear``
#: only casts for TorchScript): they keep the fast paths (local reparameterisation)
_PLAIN_SUBCLASSES = frozenset({"timm.layers.linear.Linear"})
_PLAIN_OPS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def has_own_forward(module: nn.Module) -> bool:
    """Whether a Linear/Conv computes with more than its weight's plain operation: a
    subclass that overrides ``forward`` or ``_conv_forward`` — timm's ``StdConv2d`` and
    ``ScaledStdConv2d`` (BiT, NFNet, hybrid ViTs) and Hugging Face BiT's convolutions
    standardise the weight first; timm's ``Conv2dSame`` (TensorFlow-ported EfficientNets)
    pads from the input's size. A posterior's weights must go through that forward: the
    plain operation on them is another network (up to 9 nats per example on a BiT-style
    layer)."""
    for base in _PLAIN_OPS:
        if isinstance(module, base):
            cls = type(module)
            if f"{cls.__module__}.{cls.__qualname__}" in _PLAIN_SUBCLASSES:
                return False
            return (cls.forward is not base.forward
                    or getattr(cls, "_conv_forward", None) is not getattr(base, "_conv_forward", None))
    return False


def _own_forward(module: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``module``'s own forward with ``weight``/``bias`` in place of its parameters (no bias:
    a zero bias where the module has one, the bias added after where it has none)."""
    tensors = {"weight": weight}
    own_bias = getattr(module, "bias", None)
    if own_bias is not None:
        tensors["bias"] = bias if bias is not None else torch.zeros(
            own_bias.shape, dtype=weight.dtype, device=weight.device)
    out = torch.func.functional_call(module, tensors, (x,))
    if own_bias is None and bias is not None:
        shape = [1] * out.dim()
        shape[-1 if isinstance(module, nn.Linear) else 1] = bias.shape[-1]
        out = out + bias.view(shape)
    return out


def apply_layer(
    module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``module``'s operation with ``weight``/``bias`` in place of its own.

    Linear: ``x [..., in] → [..., out]``; ConvNd: ``x [B, C, *spatial]``. A layer with its
    own forward (:func:`has_own_forward`) runs it on the given tensors.
    """
    if has_own_forward(module):
        return _own_forward(module, x, weight, bias)
    if isinstance(module, nn.Linear):
        return F.linear(x, weight, bias)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        conv = _CONV[len(module.kernel_size)]
        padding = module.padding
        if module.padding_mode != "zeros":
            pad = _explicit_padding(module)
            # F.pad takes the last dimension first, (left, right) per dimension
            x = F.pad(x, [p for p in reversed(pad) for _ in range(2)], mode=module.padding_mode)
            padding = 0
        return conv(x, weight, bias, module.stride, padding, module.dilation, module.groups)
    raise TypeError(f"no weight-space operation for {type(module).__name__}")


def member_rows(
    context: SamplingContext, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(ids [k], row_member [rows], num_members)`` for the active plan.

    ``ids``: the distinct members present in this batch (global member ids);
    ``row_member``: for every row, its position in ``ids`` (0..k-1);
    ``num_members``: M of the plan. Without members in the plan the whole
    batch is one member (one weight sample per forward pass).
    """
    member = context.plan.member
    if member is None:
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        return torch.zeros(1, dtype=torch.long, device=device), zeros, 1
    per_row = expand_plan_rows(member, rows, device)
    ids, inverse = torch.unique(per_row, sorted=True, return_inverse=True)
    return ids, inverse, int(context.plan.num_members or int(ids.max()) + 1)


def member_normal(
    context: SamplingContext,
    stream: int,
    ids: torch.Tensor,
    num_members: int,
    numel: int,
    device: torch.device,
) -> torch.Tensor:
    """``[k, numel]`` standard-normal noise, one row per member in ``ids`` (fp32).

    With a seeded plan, member ``m`` always receives row ``m`` of a ``[M, numel]``
    draw from a generator seeded by ``(seed, stream)``: reproducible and
    independent of chunking. Otherwise fresh noise from the plan's generator.
    """
    plan = context.plan
    if plan.member is not None and plan.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed((plan.seed * 999_983 + (stream + 1) * 15_485_863 + 7) % (2**62))
        full = torch.randn((num_members, numel), device=device, generator=generator)
        return full.index_select(0, ids)
    return torch.randn((ids.shape[0], numel), device=device, generator=plan.generator)


def batched_apply(
    module: nn.Module,
    x: torch.Tensor,
    weights: torch.Tensor,
    biases: torch.Tensor | None,
    row_member: torch.Tensor,
) -> torch.Tensor:
    """Rows of member ``j`` through ``module`` with ``weights[j]`` / ``biases[j]``.

    ``x [R, ...]``, ``weights [k, *weight_shape]``, ``biases [k, out]`` or None,
    ``row_member [R]`` in ``0..k-1``. Member-major equal blocks (the layout of
    ``tile``) run as one vmapped call (a grouped conv / batched matmul); any
    other layout falls back to one call per member.
    """
    k, rows = weights.shape[0], x.shape[0]
    weights = weights.to(x.dtype)
    biases = None if biases is None else biases.to(x.dtype)
    if k == 1:
        return apply_layer(module, x, weights[0], None if biases is None else biases[0])
    block = rows // k
    blocked = rows % k == 0 and torch.equal(
        row_member, torch.arange(k, device=row_member.device).repeat_interleave(block)
    )
    if blocked:
        xs = x.reshape(k, block, *x.shape[1:])
        if biases is None:
            out = torch.vmap(lambda xb, wb: apply_layer(module, xb, wb, None))(xs, weights)
        else:
            out = torch.vmap(lambda xb, wb, bb: apply_layer(module, xb, wb, bb))(xs, weights, biases)
        return out.reshape(rows, *out.shape[2:])
    outs: torch.Tensor | None = None
    for j in range(k):  # irregular layouts only: one call per member, never per row
        idx = (row_member == j).nonzero().squeeze(1)
        y = apply_layer(module, x.index_select(0, idx), weights[j],
                        None if biases is None else biases[j])
        if outs is None:
            outs = y.new_zeros((rows, *y.shape[1:]))
        outs = outs.index_copy(0, idx, y)
    assert outs is not None
    return outs


def member_training_forward(bnn: Any, x: Any, y: torch.Tensor,
                            reps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled training batch where every repeat is one member (one weight sample).

    Rows ``s·B … (s+1)·B−1`` form member ``s``: S weight samples per step in one
    forward, and the mean NLL averages every sample's likelihood.
    """
    batch = batch_rows(x)
    member = torch.arange(reps, device=batch_device(x)).repeat_interleave(batch)
    comp = torch.zeros_like(member)
    with bnn.context.use(comp, member=member, num_members=reps):
        logits = logits_of(call_model(bnn.model, tile(x, reps)))
    return logits, tile(y, reps)
