"""Save only the posterior; rebuild it on the same base model.

``bnn.save_posterior(dir)`` writes two files:

- ``posterior.safetensors``: every posterior tensor (``named_posterior_parameters``
  plus the family's ``Method.posterior_state``), keyed by the base model's own
  module names (``"layer1.0.conv1.mean"``);
- ``bayesify.json``: method, config, targets, package and format versions, the
  sha256 of the tensor file and a fingerprint of the base weights (sha256 over
  name, dtype, shape and bytes of every base ``state_dict`` tensor in name order).

``load_posterior(base_model, dir)`` checks all of that, calls
``bayesify(base_model, method, config)`` and loads the tensors strictly. Only
json and safetensors are read: nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.digests import (  # noqa: F401 - re-exported (checkpoints, users)
    fingerprint,
    fingerprint_from_digests,
    tensor_digest,
    tensor_digests,
)
from bayesify.core.extensions import provide
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

FORMAT = "bayesify-posterior"
FORMAT_VERSION = 2
BASE_PREFIX = "base."
TENSOR_FILE = "posterior.safetensors"
MANIFEST_FILE = "bayesify.json"


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def posterior_tensors(bnn: BayesianModel) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Every tensor ``save_posterior`` writes: posterior parameters, posterior buffers
    (``BayesianModel.named_posterior_buffers``: layer buffers and family state) and
    the base tensors that changed since the model was wrapped (``base.<name>``).
    Returns ``(tensors, buffer names, base names)``."""
    tensors = {name: p.detach() for name, p in bnn.named_posterior_parameters()}
    buffers = {name: b.detach() for name, b in bnn.named_posterior_buffers()}
    base = {f"{BASE_PREFIX}{k}": v for k, v in bnn.changed_base_tensors().items()}
    clash = sorted((set(tensors) & set(buffers)) | ((set(tensors) | set(buffers)) & set(base)))
    if clash:
        raise BayesifyError(f"method {bnn.method_name!r} has posterior tensor names that "
                            f"collide: {clash[:5]}")
    return {**tensors, **buffers, **base}, sorted(buffers), sorted(base)


def save_posterior(bnn: BayesianModel, directory: str | os.PathLike) -> Path:
    """Write ``posterior.safetensors`` and ``bayesify.json`` into ``directory``; returns it."""
    from safetensors.torch import save_file

    from bayesify.version import __version__

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, buffer_names, base_names = posterior_tensors(bnn)
    # safetensors refuses views / shared storage: store independent contiguous copies
    cpu = {k: v.to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    tensor_path = directory / TENSOR_FILE
    _atomic_write(tensor_path, lambda p: save_file(cpu, str(p), metadata={"format": FORMAT}))
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "bayesify_version": __version__,
        "torch_version": torch.__version__,
        "method": bnn.method_name,
        "config": bnn.config.to_dict(),
        "targets": list(bnn.targets),
        "parameters": sorted(set(tensors) - set(buffer_names) - set(base_names)),
        "state": buffer_names,
        "base_tensors": base_names,
        "base_model": type(bnn.model).__name__,
        "base_fingerprint": bnn.base_fingerprint,
        "posterior_sha256": _file_sha256(tensor_path),
    }
    manifest["checksum"] = _manifest_checksum(manifest)
    try:
        text = json.dumps(manifest, indent=2)
    except TypeError as err:
        raise BayesifyError(f"the {bnn.method_name!r} config holds a value json cannot "
                            f"store: {err}") from err
    _atomic_write(directory / MANIFEST_FILE, lambda p: p.write_text(text))
    return directory


#: a manifest is a few KiB; anything far larger is not one of ours
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
    for key in ("base_fingerprint", "posterior_sha256", "checksum"):
        if not _SHA256.fullmatch(manifest[key]):
            raise BayesifyError(f"{path}: {key!r} must be a sha256 hex digest, got "
                                f"{manifest[key][:80]!r}")
    if not all(isinstance(k, str) for k in manifest["config"]):
        raise BayesifyError(f"{path}: 'config' keys must be option names")


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


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers live on the meta device."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else empty)
    return copy.deepcopy(model, memo)


def _dry_run_shapes(base_model: nn.Module, method: str,
                    config: Any) -> dict[str, tuple[torch.dtype, tuple[int, ...]]] | None:
    """Posterior parameter ``(dtype, shape)`` that ``bayesify`` would create, on the meta
    device (nothing allocated); ``None`` when a family cannot be built on meta."""
    from bayesify.core.factory import bayesify

    for default_meta in (True, False):
        try:
            with torch.device("meta") if default_meta else contextlib.nullcontext():
                dry = bayesify(_meta_copy(base_model), method, config=config, inplace=True)
        except BayesifyError:
            raise
        except Exception:  # noqa: BLE001, S112 - a data-dependent op on meta: try the next way
            continue
        return {n: (p.dtype, tuple(p.shape)) for n, p in dry.named_posterior_parameters()}
    return None


def check_against_header(manifest: dict[str, Any], header: dict[str, tuple[str, tuple[int, ...]]],
                         expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None,
                         tensor_path: Path) -> None:
    """Names in the manifest, the file header and (when known) the rebuilt model agree."""
    listed = (set(manifest["parameters"]) | set(manifest["state"])
              | set(manifest.get("base_tensors") or []))
    if set(header) != listed:
        missing, extra = sorted(listed - set(header)), sorted(set(header) - listed)
        raise BayesifyError(f"{tensor_path} does not hold the tensors the manifest lists "
                            f"(missing {missing[:5]}, unexpected {extra[:5]})")
    if expected is None:
        return
    if set(expected) != set(manifest["parameters"]):
        missing = sorted(set(expected) - set(manifest["parameters"]))
        extra = sorted(set(manifest["parameters"]) - set(expected))
        raise BayesifyError(
            f"the manifest's method {manifest['method']!r} with its config would create "
            f"posterior tensors {missing[:5]} that the file lacks, and the file has "
            f"{extra[:5]} that it would not create; the manifest does not describe this file"
        )
    for name, (dtype, shape) in expected.items():
        saved_dtype, saved_shape = header[name]
        if saved_shape != shape or saved_dtype != _SAFETENSORS_DTYPES.get(dtype, str(dtype)):
            raise BayesifyError(
                f"posterior tensor {name!r} is {saved_dtype}{list(saved_shape)} in {tensor_path}, "
                f"but the model built from the manifest's config ({manifest['method']!r}) expects "
                f"{_SAFETENSORS_DTYPES.get(dtype, dtype)}{list(shape)}: refused before "
                "allocating anything (the manifest or the file was altered)"
            )


def load_posterior(base_model: nn.Module, directory: str | os.PathLike) -> BayesianModel:
    """Rebuild the saved posterior around ``base_model`` (copied) and load it strictly.

    Raises :class:`BayesifyError` when the manifest is malformed, the base weights
    differ from those the posterior was fitted on, the tensor file was altered,
    or tensors are missing, extra or of the wrong shape / dtype. Shapes implied
    by the manifest's config are compared with the tensor file's header on a
    meta-device dry run *before* anything is allocated.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from bayesify.core.factory import bayesify
    from bayesify.core.registry import get_method_class

    directory = Path(directory)
    manifest = read_manifest(directory)
    tensor_path = directory / TENSOR_FILE
    if not tensor_path.is_file():
        raise BayesifyError(f"{tensor_path} is missing; the saved posterior is incomplete")
    if _file_sha256(tensor_path) != manifest["posterior_sha256"]:
        raise BayesifyError(f"{tensor_path} does not match the sha256 recorded in "
                            f"{MANIFEST_FILE}: the tensor file was modified or replaced")
    base_print = fingerprint(base_model.state_dict())
    if base_print != manifest["base_fingerprint"]:
        raise BayesifyError(
            f"the base model ({type(base_model).__name__}, weights fingerprint {base_print[:12]}…) "
            f"is not the one this posterior was fitted on ({manifest.get('base_model')}, "
            f"{manifest['base_fingerprint'][:12]}…); pass the same architecture with the same "
            "weights (and save the base model too if its weights were fine-tuned)"
        )
    method = manifest["method"]
    try:
        config = get_method_class(method).config_cls.from_kwargs(method, dict(manifest["config"]))
    except (BayesifyError, TypeError) as err:
        raise BayesifyError(f"{directory / MANIFEST_FILE}: its config is not valid ({err})") from err
    header = read_tensor_header(tensor_path)
    check_against_header(manifest, header, _dry_run_shapes(base_model, method, config), tensor_path)
    bnn = bayesify(base_model, method, config=config)
    if list(bnn.targets) != list(manifest["targets"]):
        raise BayesifyError(f"re-bayesifying wrapped {bnn.targets[:5]}… but the posterior was "
                            f"saved for {manifest['targets'][:5]}…")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError) as err:
        raise BayesifyError(f"cannot read {tensor_path}: {err}") from err
    base_names = set(manifest.get("base_tensors", []))
    with torch.no_grad():
        base = bnn.base_state_dict()
        for key in sorted(base_names):
            name = key[len(BASE_PREFIX):]
            if name not in base or key not in tensors or tensors[key].shape != base[name].shape:
                raise BayesifyError(f"{tensor_path}: saved base tensor {name!r} does not fit "
                                    "the base model")
            base[name].copy_(tensors[key])
    expected = dict(bnn.named_posterior_parameters())
    expected.update(dict(bnn.named_posterior_buffers()))
    _load_tensors(bnn, expected, {k: v for k, v in tensors.items() if k not in base_names})
    bnn.eval()
    return bnn


def _load_tensors(bnn: BayesianModel, params: dict[str, torch.Tensor],
                  tensors: dict[str, torch.Tensor]) -> None:
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        raise BayesifyError(
            f"posterior tensors do not match method {bnn.method_name!r}: missing {missing[:5]}"
            f"{'…' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{'…' if len(extra) > 5 else ''}"
        )
    for name, param in params.items():
        value = tensors[name]
        if value.shape != param.shape or value.dtype != param.dtype:
            raise BayesifyError(
                f"posterior tensor {name!r} is {value.dtype}{list(value.shape)} in the file "
                f"but the model expects {param.dtype}{list(param.shape)}"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])


provide("save_posterior", save_posterior)  # bnn.save_posterior(dir)
