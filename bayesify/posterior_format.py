"""The posterior tensor file's header and the dtypes a saved model had.

- :func:`read_tensor_header` / :func:`header_from_bytes`: ``{name: (dtype, shape)}``
  from a ``safetensors`` header without touching tensor data (checked: length,
  JSON, entries, data offsets inside the file);
- :func:`dtype_record` / :func:`restore_dtypes`: the floating dtype of every
  parameter and buffer when a model is saved (the most common one plus the
  exceptions), re-applied on load, so a ``.half()``-ed, ``.double()``-ed or mixed
  model comes back as it was saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

__all__ = ["SAFETENSORS_DTYPES", "dtype_record", "header_from_bytes", "read_tensor_header",
           "restore_dtypes"]


def read_tensor_header(tensor_path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from the safetensors header, without reading tensor data."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(tensor_path), framework="pt") as fh:
            header = {}
            names = fh.keys()
            for name in names:
                piece = fh.get_slice(name)
                header[name] = (str(piece.get_dtype()), tuple(int(d) for d in piece.get_shape()))
    except (SafetensorError, OSError, ValueError) as err:
        raise BayesifyError(f"cannot read the header of {tensor_path}: {err}") from err
    return header


def header_from_bytes(data: bytes, path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from the safetensors header held in ``data`` (checked:
    length, JSON, entries and data offsets inside the file)."""
    if len(data) < 8:
        raise BayesifyError(f"cannot read the header of {path}: the file is truncated")
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > len(data):
        raise BayesifyError(f"cannot read the header of {path}: header length {size} does not "
                            f"fit the {len(data)}-byte file")
    try:
        raw = json.loads(data[8:8 + size])
    except (ValueError, RecursionError) as err:
        raise BayesifyError(f"cannot read the header of {path}: {err}") from err
    if not isinstance(raw, dict):
        raise BayesifyError(f"cannot read the header of {path}: not a JSON object")
    header, body = {}, len(data) - 8 - size
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (isinstance(dtype, str) and all(type(d) is int and d >= 0 for d in shape)
                  and type(begin) is int and type(end) is int and 0 <= begin <= end <= body)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise BayesifyError(f"cannot read the header of {path}: entry {name!r} is malformed")
        header[name] = (dtype, tuple(shape))
    return header


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def dtype_record(bnn: BayesianModel) -> dict[str, Any]:
    """Floating dtypes of every parameter and buffer of ``bnn``: the most common one
    (``"default"``) and the exceptions by name, so ``load_posterior`` can restore a
    model that was ``.half()``-ed or ``.double()``-ed before it was saved."""
    dtypes = {n: str(t.dtype).removeprefix("torch.")
              for n, t in [*bnn.named_parameters(), *bnn.named_buffers()]
              if t.is_floating_point()}
    if not dtypes:
        return {"default": None, "except": {}}
    values = list(dtypes.values())
    default = max(set(values), key=values.count)
    return {"default": default, "except": {n: d for n, d in dtypes.items() if d != default}}


def restore_dtypes(bnn: BayesianModel, record: Any, where: Path) -> None:
    """Cast ``bnn``'s floating parameters and buffers to the dtypes in ``record``."""
    if not isinstance(record, dict) or not isinstance(record.get("except", {}), dict):
        raise BayesifyError(f"{where}: 'dtypes' must be an object with 'default' and 'except'")
    default, exceptions = record.get("default"), record.get("except", {})

    def dtype(name: str) -> torch.dtype | None:
        value = exceptions.get(name, default)
        if value is None:
            return None
        found = getattr(torch, str(value), None)
        if not isinstance(found, torch.dtype) or not found.is_floating_point:
            raise BayesifyError(f"{where}: {value!r} is not a floating dtype")
        return found

    with torch.no_grad():
        for name, p in bnn.named_parameters():
            target = dtype(name)
            if p.is_floating_point() and target is not None and p.dtype != target:
                p.data = p.data.to(target)
        for name, b in list(bnn.named_buffers()):
            target = dtype(name)
            if b.is_floating_point() and target is not None and b.dtype != target:
                owner, _, attr = name.rpartition(".")
                setattr(bnn.get_submodule(owner) if owner else bnn, attr, b.to(target))
