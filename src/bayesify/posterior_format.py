"""The on-disk format of a saved posterior: file names, the manifest, the tensor header, dtypes.

- :func:`read_manifest`: the checked ``bayesify.json`` (size, JSON, depth, format
  version, every key's type, checksum) — what both the loader and the atomic commit
  (:mod:`bayesify.posterior_commit`) read;

- :func:`read_tensor_header` / :func:`header_from_bytes`: ``{name: (dtype, shape)}``
  from a ``safetensors`` header without touching tensor data (checked: length,
  JSON, entries, data offsets inside the file);
- :func:`dtype_record` / :func:`restore_dtypes`: the floating dtype of every
  parameter and buffer when a model is saved (the most common one plus the
  exceptions), re-applied on load, so a ``.half()``-ed, ``.double()``-ed or mixed
  model comes back as it was saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

__all__ = ["MANIFEST_FILE", "SAFETENSORS_DTYPES", "TENSOR_FILE", "dtype_record", "header_extent", "header_from_bytes",
           "read_manifest", "read_tensor_header", "restore_dtypes"]


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
    return header_extent(data, path)[0]


def header_extent(data: bytes, path: Path, *, file_size: int | None = None,
                  ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], int]:
    """``(header, end of the last tensor's data)`` from a safetensors file's first bytes
    ``data`` (at least the header); ``file_size``: the whole file's size when ``data``
    holds only its beginning (default ``len(data)``)."""
    size_of_file = len(data) if file_size is None else file_size
    if len(data) < 8:
        raise BayesifyError(f"cannot read the header of {path}: the file is truncated")
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > min(len(data), size_of_file):
        raise BayesifyError(f"cannot read the header of {path}: header length {size} does not "
                            f"fit the {size_of_file}-byte file")
    try:
        raw = json.loads(data[8:8 + size])
    except (ValueError, RecursionError) as err:
        raise BayesifyError(f"cannot read the header of {path}: {err}") from err
    if not isinstance(raw, dict):
        raise BayesifyError(f"cannot read the header of {path}: not a JSON object")
    header, body, extent = {}, size_of_file - 8 - size, 0
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
        extent = max(extent, end)
    return header, 8 + size + extent


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


FORMAT = "bayesify-posterior"
FORMAT_VERSION = 2
BASE_PREFIX = "base."
TENSOR_FILE = "posterior.safetensors"
MANIFEST_FILE = "bayesify.json"


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


MAX_MANIFEST_BYTES = 16 << 20
#: nesting depth allowed anywhere in the manifest (configs are flat)
MAX_MANIFEST_DEPTH = 32
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: key → (JSON type(s), what it must be), checked before anything reads them
_MANIFEST_KEYS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "format": (str, "a string"),
    "format_version": (int, "a positive integer"),
    "method": (str, "a method name"),
    "config": (dict, "an object of config options"),
    "targets": (list, "a list of module names"),
    "parameters": (list, "a list of tensor names"),
    "state": (list, "a list of tensor names"),
    "base_tensors": (list, "a list of tensor names"),
    "base_fingerprint": (str, "a sha256 hex digest"),
    "posterior_sha256": (str, "a sha256 hex digest"),
    "checksum": (str, "a sha256 hex digest"),
}


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, iteratively (no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def _check_manifest_structure(manifest: dict[str, Any], path: Path) -> None:
    for key, (kind, what) in _MANIFEST_KEYS.items():
        if key not in manifest:
            raise BayesifyError(f"{path} lacks the key {key!r}; the manifest is damaged or was "
                                "edited: re-save the posterior with bnn.save_posterior(dir)")
        value = manifest[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise BayesifyError(f"{path}: {key!r} must be {what}, got {type(value).__name__} "
                                f"{str(value)[:80]!r}")
    for key in ("targets", "parameters", "state", "base_tensors"):
        names = manifest[key]
        if not all(isinstance(n, str) and n for n in names):
            raise BayesifyError(f"{path}: every entry of {key!r} must be a non-empty string")
        if len(set(names)) != len(names):
            raise BayesifyError(f"{path}: {key!r} lists a name twice")
    both = set(manifest["parameters"]) & set(manifest["state"])
    if both:
        raise BayesifyError(f"{path}: {sorted(both)[:5]} are listed as parameters and as state")
    for key in ("base_fingerprint", "posterior_sha256", "checksum", "base_fingerprint_saved"):
        if key in manifest and not (isinstance(manifest[key], str)
                                    and _SHA256.fullmatch(manifest[key])):
            raise BayesifyError(f"{path}: {key!r} must be a sha256 hex digest, got "
                                f"{manifest[key][:80]!r}")
    if not all(isinstance(k, str) for k in manifest["config"]):
        raise BayesifyError(f"{path}: 'config' keys must be option names")
    stored_fn = manifest.get("output_fn")
    if not (stored_fn is None or (isinstance(stored_fn, (str, int)) and not isinstance(stored_fn, bool))
            or (isinstance(stored_fn, dict) and isinstance(stored_fn.get("callable"), str))):
        raise BayesifyError(f"{path}: 'output_fn' must be a name, an index or "
                            f"{{'callable': name}}, got {str(stored_fn)[:80]!r}")
    for key, valid in (("posterior_bytes", lambda v: type(v) is int and v >= 8),
                       ("base_architecture", lambda v: isinstance(v, str) and _SHA256.fullmatch(v)),
                       ("base_modules", lambda v: isinstance(v, list) and all(
                           isinstance(e, list) and len(e) == 3
                           and all(isinstance(x, str) for x in e) for e in v)),
                       ("signature", lambda v: isinstance(v, str) and len(v) < 256)):
        if key in manifest and not valid(manifest[key]):
            raise BayesifyError(f"{path}: {key!r} is malformed ({str(manifest[key])[:80]!r})")
    dtypes = manifest.get("dtypes", {"default": None})
    if not (isinstance(dtypes, dict) and isinstance(dtypes.get("except", {}), dict)):
        raise BayesifyError(f"{path}: 'dtypes' must be an object with 'default' and 'except'")


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The checked ``bayesify.json`` of a saved posterior.

    Checked, in order, before any value is used: size, valid JSON, nesting depth,
    format, ``format_version`` (an integer, not ``true``), every required key with
    its JSON type, then the checksum. Every failure is a :class:`BayesifyError`.
    """
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise BayesifyError(f"no {MANIFEST_FILE} in {directory}: not a saved posterior "
                            "(write one with bnn.save_posterior(dir))")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise BayesifyError(f"{path} is {size} bytes, far more than a posterior manifest "
                            f"(limit {MAX_MANIFEST_BYTES}); it is not one")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BayesifyError(f"{path} is not valid JSON ({err}); the file is damaged") from err
    except RecursionError as err:
        raise BayesifyError(f"{path} is nested too deeply to be a posterior manifest") from err
    if _depth(manifest) > MAX_MANIFEST_DEPTH:
        raise BayesifyError(f"{path} is nested deeper than {MAX_MANIFEST_DEPTH} levels; a "
                            "posterior manifest is flat")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BayesifyError(f"{path} is not a bayesify posterior manifest "
                            f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("format_version")
    if type(version) is not int or version < 1:
        raise BayesifyError(f"{path} has an invalid format_version {version!r} (a positive "
                            f"integer, {FORMAT_VERSION} for this bayesify)")
    if version < FORMAT_VERSION:
        raise BayesifyError(
            f"{path} has format version {version}, written by bayesify "
            f"{manifest.get('bayesify_version')} before posterior state and base fingerprints "
            f"were redone (version {FORMAT_VERSION}); refit and save the posterior again"
        )
    if version > FORMAT_VERSION:
        raise BayesifyError(
            f"{path} has format version {version}, newer than this bayesify supports "
            f"({FORMAT_VERSION}; it was written by bayesify "
            f"{manifest.get('bayesify_version')}); upgrade bayesify to load it"
        )
    _check_manifest_structure(manifest, path)
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise BayesifyError(f"{path} was modified after it was written (checksum mismatch); "
                            "re-save the posterior instead of editing the manifest")
    return manifest
