"""Checks of user data at the entry points (fit, predictor, calibrate, Laplace).

Each helper raises a :class:`BayesifyError` that says where (``where=``, e.g.
``"fit"``), what was wrong and what would be right, instead of the bare torch
error (``IndexError: Target 7 is out of bounds``, ``_LinAlgError``) that the
bad value would cause several calls later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bayesify.errors import BayesifyError

__all__ = [
    "check_finite_batch",
    "check_finite_inputs",
    "check_finite_logits",
    "check_labels",
    "check_nonempty",
    "explain_shapes",
    "input_shapes",
    "unusable",
    "unusable_mask",
]


#: headroom below a dtype's largest value: a tensor beyond it overflows at the next
#: product or square (a BatchNorm variance of 1e35 is not a statistic)
_HEADROOM = 2.0**-20


def _limit(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    # fp16 has too little range for headroom to mean anything: only inf/NaN there
    return info.max * _HEADROOM if info.max > 1e30 else float("inf")


def unusable(tensor: torch.Tensor) -> bool:
    """A floating tensor holding NaN, ±inf or a magnitude beyond ``finfo.max / 2**20``
    (fp32 / fp64 / bf16): what no step, checkpoint or saved posterior may keep."""
    return unusable_mask([tensor])[0]


def unusable_mask(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """:func:`unusable` of every tensor, read back with one synchronisation per device.

    The guard checks every trainable tensor after every optimiser step: two ``bool()``
    reads per tensor were two GPU synchronisations each (216 per iBNN step on a ResNet-50,
    measured on an H100); here the peaks ``max |t|`` (NaN propagates through ``amax``)
    are stacked on the device and compared there."""
    out = [False] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and t.numel() > 0:
            by_device.setdefault(t.device, []).append(i)
    for device, index in by_device.items():
        with torch.no_grad():
            peaks = torch.stack([tensors[i].detach().abs().amax().double() for i in index])
            limits = torch.tensor([_limit(tensors[i].dtype) for i in index],
                                  dtype=torch.float64, device=device)
            bad = (~torch.isfinite(peaks)) | (peaks > limits)
        for i, flag in zip(index, bad.tolist()):
            out[i] = bool(flag)
    return out


def check_labels(labels: Any, num_classes: int | None, *, where: str) -> torch.Tensor:
    """Class-index labels ``[N]`` in ``[0, num_classes)``; returns them as ``int64``.

    Refused: non-tensors, floating / complex / bool labels (one-hot or soft labels
    are not class indices), labels of more than one dimension, and any label
    outside ``[0, num_classes)`` (the message names the range and the offenders).
    ``num_classes=None`` checks only ``>= 0``.
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{where}: labels must be a tensor of class indices, got "
                        f"{type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise BayesifyError(
            f"{where}: labels must be integer class indices (torch.long) of shape [N], got "
            f"{labels.dtype} labels of shape {tuple(labels.shape)}; convert with labels.long() "
            "if they are whole numbers, or argmax(-1) if they are one-hot"
        )
    if labels.dim() != 1:
        raise BayesifyError(f"{where}: labels must have shape [N] (one class index per example), "
                            f"got shape {tuple(labels.shape)}")
    if num_classes is not None and (isinstance(num_classes, bool) or num_classes < 1):
        raise BayesifyError(f"{where}: num_classes must be a positive integer, got {num_classes!r}")
    if labels.numel():
        low, high = int(labels.min()), int(labels.max())
        upper = num_classes if num_classes is not None else None
        if low < 0 or (upper is not None and high >= upper):
            mask = labels < 0
            if upper is not None:
                mask |= labels >= upper
            bad = labels[mask]
            shown = sorted({int(v) for v in bad[:1000].tolist()})[:5]
            valid = f"[0, {upper - 1}]" if upper is not None else ">= 0"
            raise BayesifyError(
                f"{where}: labels must be class indices in {valid} (the model has "
                f"{upper if upper is not None else '?'} classes); found {bad.numel()} outside, "
                f"e.g. {shown} (negative labels usually mark an out-of-distribution loader)"
            )
    return labels.long()


def check_finite_inputs(inputs: Any, *, where: str) -> None:
    """Every floating tensor in ``inputs`` (a tensor, or a mapping / sequence of them) is finite.

    Integer tensors (token ids, masks) are not inspected. Raises
    :class:`BayesifyError` naming the entry and how many values are NaN / inf.
    """
    for name, tensor in _floating_tensors(inputs, "inputs"):
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            nan = int(torch.isnan(tensor).sum())
            inf = int((~finite).sum()) - nan
            rows = ""
            if tensor.dim() >= 1:
                bad_rows = (~finite).reshape(tensor.shape[0], -1).any(1).nonzero().flatten()
                rows = f" in rows {bad_rows[:5].tolist()}{'…' if bad_rows.numel() > 5 else ''}"
            raise BayesifyError(
                f"{where}: {name} holds {nan} NaN and {inf} infinite values{rows} "
                f"(shape {tuple(tensor.shape)}); clean or drop those examples first"
            )


def check_finite_batch(inputs: Any, *, where: str,
                       error: type[BayesifyError] = BayesifyError) -> None:
    """:func:`check_finite_inputs` of a tensor or a :class:`~bayesify.core.batch.Batch`
    (its positional and keyword inputs; labels are checked by :func:`check_labels`)."""
    args = getattr(inputs, "args", None)
    if args is not None:  # a Batch: its positional inputs, then its keyword inputs
        kwargs = inputs.kwargs
        inputs = args[0] if len(args) == 1 and not kwargs else [*args, kwargs]
    try:
        check_finite_inputs(inputs, where=where)
    except BayesifyError as err:
        if error is BayesifyError:
            raise
        raise error(str(err)) from None


def check_finite_logits(logits: torch.Tensor, *, where: str) -> None:
    """Logits ``[..., C]`` must be finite (a NaN logit poisons every probability of its row)."""
    if not bool(torch.isfinite(logits).all()):
        bad = ~torch.isfinite(logits)
        count = int(bad.reshape(-1, logits.shape[-1]).any(-1).sum()) if logits.dim() else 1
        raise BayesifyError(
            f"{where}: the model produced non-finite logits for {count} example row(s) "
            f"(shape {tuple(logits.shape)}); check the inputs for NaN/inf and the posterior "
            "for a diverged fit"
        )


def check_nonempty(count: int, *, where: str, what: str = "the loader") -> None:
    """``count`` examples/batches must be > 0."""
    if count <= 0:
        raise BayesifyError(f"{where}: {what} produced no examples; pass a loader (or tensor) "
                            "with at least one example")


def _floating_tensors(value: Any, name: str):
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _floating_tensors(item, f"{name}[{key!r}]")
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        for i, item in enumerate(value):
            yield from _floating_tensors(item, f"{name}[{i}]")


class _ShapeMismatch(Exception):
    """Raised by a pre-hook of :func:`explain_shapes`; carries the user-facing message."""


def input_shapes(inputs: Any) -> str:
    """The user's input shape(s) as text: ``(8, 1, 32, 32)`` or ``{'input_ids': (8, 12)}``."""
    if isinstance(inputs, torch.Tensor):
        return str(tuple(inputs.shape))
    args, kwargs = getattr(inputs, "args", ()), getattr(inputs, "kwargs", {})
    shapes = [str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor)]
    shapes += [f"{k}: {tuple(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return shapes[0] if len(shapes) == 1 and not kwargs else "{" + ", ".join(shapes) + "}"


def _shape_fix(layer: torch.nn.Module, x: torch.Tensor, seen_conv: bool) -> str | None:
    """What is wrong with ``x`` as the input of the plain conv / linear ``layer`` and the
    likely fix; None when it fits."""
    from torch import nn

    if isinstance(layer, nn.modules.conv._ConvNd):
        spatial, channels = len(layer.kernel_size), layer.in_channels
        if x.dim() == spatial + 1:
            return (f"it expects a batch [B, {channels}, ...] but got a single example: add a "
                    "batch dimension (x.unsqueeze(0), or pass a list of images stacked with "
                    "torch.stack)")
        if x.dim() != spatial + 2:
            return (f"it expects {spatial + 2}-dimensional batches [B, {channels}, ...], got "
                    f"{x.dim()} dimensions")
        if x.shape[1] == channels:
            return None
        if spatial == 2 and x.shape[-1] == channels:
            return (f"it expects channels first [B, {channels}, H, W]; this looks like channels "
                    "last (HWC images): permute to channels-first with x.permute(0, 3, 1, 2)")
        if x.shape[1] == 1 and channels == 3:
            return ("it expects 3 channels (RGB) and got 1 (grayscale): repeat the channel with "
                    "x.expand(-1, 3, -1, -1), or convert the images to RGB when loading them")
        return f"it expects {channels} channels along axis 1, got {x.shape[1]}"
    if isinstance(layer, nn.Linear):
        features = layer.in_features
        if x.dim() >= 1 and x.shape[-1] == features:
            return None
        got = x.shape[-1] if x.dim() else "a scalar"
        if seen_conv:
            return (f"it expects {features} features and got {got} from the layers before it: "
                    "the images are not the size the network was built for; resize (or "
                    "crop) them to the resolution it was trained at")
        return f"it expects {features} features in the last axis, got {got}"
    return None


def explain_shapes(model: torch.nn.Module, run: Any, *, inputs: Any, where: str) -> None:
    """Re-run ``run()`` (a forward of ``model`` on the user's untiled ``inputs``) with a check
    before every convolution and linear layer; at the first layer whose input does not fit,
    raise a :class:`BayesifyError` naming the layer, the user's input shape and the likely
    fix (add a batch dimension, permute HWC to CHW, repeat a grey channel, resize). Returns
    quietly when every layer's input fits (the failure lies elsewhere: the caller re-raises
    its own error)."""
    from torch import nn

    from bayesify.core.layers import BayesianLayer

    seen = {"conv": False}
    handles = []

    def checker(name: str, layer: nn.Module):
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                return
            fix = _shape_fix(layer, x, seen["conv"])
            if isinstance(layer, nn.modules.conv._ConvNd):
                seen["conv"] = True
            if fix is not None:
                given, received = input_shapes(inputs), str(tuple(x.shape))
                raise _ShapeMismatch(
                    f"{where}: the input does not fit layer {name!r} ({type(layer).__name__}): "
                    f"{fix}. Your input has shape {given}"
                    + ("" if received == given else f"; the layer received {received}"))
        return hook

    wrapped = set()
    for name, module in model.named_modules():
        layer = module.base_layer if isinstance(module, BayesianLayer) else module
        if isinstance(module, BayesianLayer):
            wrapped.add(id(layer))
        elif id(module) in wrapped:
            continue  # the wrapper's hook checks it
        if isinstance(layer, (nn.modules.conv._ConvNd, nn.Linear)):
            handles.append(module.register_forward_pre_hook(checker(name, layer)))
    try:
        with torch.no_grad():
            run()
    except _ShapeMismatch as mismatch:
        raise BayesifyError(str(mismatch)) from None
    except Exception:  # noqa: BLE001 - not a shape the hooks can name: the caller's error stands
        return
    finally:
        for handle in handles:
            handle.remove()
