"""Save only the posterior; rebuild it on the same base model.

``bnn.save_posterior(dir)`` writes two files:

- ``posterior.safetensors``: every posterior tensor (``named_posterior_parameters``
  plus the family's ``Method.posterior_state``), keyed by the base model's own
  module names (``"layer1.0.conv1.mean"``);
- ``bayesify.json``: method, config, targets, package and format versions, the
  sha256 and size of the tensor file, a fingerprint of the base weights (sha256 over
  name, dtype, shape and bytes of every base ``state_dict`` tensor in name order) and
  one of the base's computation (``base_architecture``: module classes and settings in
  order, :func:`bayesify.core.digests.architecture_record`); with ``key=`` an HMAC
  signature.

``load_posterior(base_model, dir)`` checks all of that, calls
``bayesify(base_model, method, config)`` and loads the tensors strictly. Only
json and safetensors are read: nothing is ever unpickled.

**Accident vs attack.** The manifest's checksum and the tensor sha256 catch damage
and careless edits, not a deliberate edit (anyone can recompute them). With
``save_posterior(dir, key=...)`` the manifest carries ``signature`` = HMAC-SHA256 of
the manifest under the user's key (the manifest holds the tensor file's sha256, so the
signature covers both); ``load_posterior(..., key=...)`` refuses an unsigned posterior
or one whose signature does not verify. Without ``key`` a signature is not checked.

**Backward compatibility.** Manifests written before ``base_architecture`` existed
load on the weights fingerprint alone; before ``posterior_bytes``, the tensor file's
size is checked against its own header and the header's shapes against the dry run.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.atomic_files import directory_lock
from bayesify.core.digests import (  # noqa: F401 - re-exported (checkpoints, users)
    architecture_fingerprint,
    architecture_record,
    fingerprint,
    fingerprint_from_digests,
    first_architecture_difference,
    tensor_digest,
    tensor_digests,
)
from bayesify.core.extensions import provide
from bayesify.errors import BayesifyError
from bayesify.kit import laplace_heads
from bayesify.posterior_format import (  # noqa: F401 - re-exported (the public names)
    BASE_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    SAFETENSORS_DTYPES,
    TENSOR_FILE,
    _check_manifest_structure,
    _manifest_checksum,
    dtype_record,
    header_from_bytes,
    read_manifest,
    read_tensor_header,
    restore_dtypes,
)

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


def _json_default(value: Any) -> Any:
    """numpy / torch scalars (and arrays) become Python numbers (lists); else refused."""
    if callable(getattr(value, "tolist", None)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} {value!r:.60} is not JSON serialisable")


#: architecture records longer than this are stored as their fingerprint only
MAX_RECORDED_MODULES = 20_000
SIGNATURE_PREFIX = "hmac-sha256:"


def _key_bytes(key: str | bytes) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise BayesifyError(f"key must be non-empty bytes or a string, got {type(key).__name__}")
    return bytes(key)


def manifest_signature(manifest: Mapping[str, Any], key: str | bytes) -> str:
    """``hmac-sha256:<hex>`` over the manifest without ``checksum`` and ``signature``."""
    body = {k: v for k, v in manifest.items() if k not in ("checksum", "signature")}
    digest = hmac.new(_key_bytes(key), json.dumps(body, sort_keys=True).encode(), hashlib.sha256)
    return SIGNATURE_PREFIX + digest.hexdigest()


def verify_signature(manifest: Mapping[str, Any], key: str | bytes | None, where: Path) -> None:
    """With a ``key``: the manifest must carry a signature made with it."""
    if key is None:
        return
    expected = manifest_signature(manifest, key)
    stored = manifest.get("signature")
    if not isinstance(stored, str):
        raise BayesifyError(f"{where} is not signed, but key= was given: refusing an unsigned "
                            "posterior (save it with save_posterior(dir, key=...), or load "
                            "without key= if you trust it)")
    if not hmac.compare_digest(stored, expected):
        raise BayesifyError(f"{where}: the signature does not verify with the given key: the "
                            "manifest was edited after it was signed, or was signed with "
                            "another key; refusing it")


def build_manifest(bnn: BayesianModel, tensors: dict[str, torch.Tensor], buffer_names: list[str],
                   base_names: list[str], posterior_sha256: str, *, posterior_bytes: int | None = None,
                   key: str | bytes | None = None) -> tuple[dict[str, Any], str]:
    """The manifest of a save and its JSON text; every check the loader runs on its
    structure runs here too, so a save that could not be read back fails before the
    first byte is written."""
    from bayesify.core.outputs import output_fn_of, output_fn_record
    from bayesify.version import __version__

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "bayesify_version": __version__,
        "torch_version": torch.__version__,
        "method": bnn.method_name,
        "config": bnn.method.config.to_dict(),
        "targets": list(bnn.targets),
        "parameters": sorted(set(tensors) - set(buffer_names) - set(base_names)),
        "state": buffer_names,
        "base_tensors": base_names,
        "base_model": type(bnn.model).__name__,
        "base_fingerprint": bnn.base_fingerprint,
        # the base as saved (after .half(), a fine-tune): loading onto that network works too
        "base_fingerprint_saved": fingerprint(bnn.base_state_dict()),
        "posterior_sha256": posterior_sha256,
        **({} if posterior_bytes is None else {"posterior_bytes": int(posterior_bytes)}),
        **_architecture_entries(getattr(bnn, "base_architecture", None)),
        "dtypes": dtype_record(bnn),
        "output_fn": output_fn_record(output_fn_of(bnn.model)),
        # the saved temperature acts on the predictive: softmax(log p̄ / T)
        "temperature_kind": TEMPERATURE_KIND,
        "temperature_source": getattr(bnn, "temperature_source", "default"),
        "num_classes": head_classes(bnn.model),
    }
    try:  # numpy / torch scalars in a config become plain numbers
        manifest = json.loads(json.dumps(manifest, default=_json_default, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise BayesifyError(f"the {bnn.method_name!r} config holds a value json cannot "
                            f"store: {err}") from err
    if key is not None:
        manifest["signature"] = manifest_signature(manifest, key)
    manifest["checksum"] = _manifest_checksum(manifest)
    _check_manifest_structure(manifest, Path(MANIFEST_FILE))
    return manifest, json.dumps(manifest, indent=2)


def _architecture_entries(record: list[list[str]] | None) -> dict[str, Any]:
    if not record:
        return {}
    entries: dict[str, Any] = {"base_architecture": architecture_fingerprint(record)}
    if len(record) <= MAX_RECORDED_MODULES:
        entries["base_modules"] = record
    return entries


def check_architecture(manifest: Mapping[str, Any], base_model: nn.Module, where: Path) -> None:
    """The base computes what it computed when the posterior was saved (module classes
    and settings in order); manifests without ``base_architecture`` are not checked."""
    saved = manifest.get("base_architecture")
    if saved is None:
        return
    current = architecture_record(base_model)
    if architecture_fingerprint(current) == saved:
        return
    recorded = manifest.get("base_modules")
    what = (first_architecture_difference(recorded, current) if isinstance(recorded, list)
            else "its module classes or settings differ")
    raise BayesifyError(
        f"the base model ({type(base_model).__name__}) has the weights this posterior was fitted "
        f"on but computes differently: {what}. Pass the network the posterior was fitted on "
        f"(same module classes and settings); see {where}")


def save_posterior(bnn: BayesianModel, directory: str | os.PathLike, *,
                   key: str | bytes | None = None) -> Path:
    """Write ``posterior.safetensors`` and ``bayesify.json`` into ``directory``; returns it.

    One atomic commit (see :mod:`bayesify.posterior_commit`): after a failure or a
    kill at any point the directory loads as the previous posterior or the new one.
    Refused before anything is written: non-finite tensors, a config JSON cannot hold,
    a directory whose ``bayesify.json`` is not a bayesify posterior's. ``key``: sign
    the manifest with HMAC-SHA256 (``load_posterior(..., key=...)`` verifies it).
    """
    from safetensors.torch import save as serialise

    from bayesify.posterior_commit import commit_posterior

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise BayesifyError(f"{directory} exists and is not a directory")
    tensors, buffer_names, base_names = posterior_tensors(bnn)
    bad = unusable_tensors(tensors)
    if bad:
        raise BayesifyError(
            f"refusing to save the posterior of {bnn.method_name!r}: {bad[:5]}"
            f"{'…' if len(bad) > 5 else ''} hold NaN/inf or overflowing values (a diverged fit or "
            f"poisoned statistics); nothing was written to {directory}")
    # safetensors refuses views / shared storage: store independent contiguous copies
    cpu = {k: v.to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    data = serialise(cpu, metadata={"format": FORMAT})
    _, text = build_manifest(bnn, tensors, buffer_names, base_names,
                             hashlib.sha256(data).hexdigest(), posterior_bytes=len(data), key=key)
    directory.mkdir(parents=True, exist_ok=True)
    commit_posterior(directory, data, text.encode())
    return directory


def unusable_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of floating tensors holding NaN, ±inf or overflowing values
    (:func:`bayesify.core.checks.unusable`)."""
    from bayesify.core.checks import unusable_mask

    names = list(tensors)
    return [n for n, bad in zip(names, unusable_mask([tensors[n] for n in names])) if bad]


#: a manifest is a few KiB; anything far larger is not one of ours
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
    recorded = manifest.get("dtypes") if isinstance(manifest.get("dtypes"), dict) else {}
    # a model saved after .half() / .double(): the dtypes it was saved in are recorded
    cast = {SAFETENSORS_DTYPES.get(getattr(torch, str(d), None), "?")
            for d in [recorded.get("default"), *(recorded.get("except") or {}).values()]}
    for name, (dtype, shape) in expected.items():
        saved_dtype, saved_shape = header[name]
        wanted = SAFETENSORS_DTYPES.get(dtype, str(dtype))
        if saved_shape != shape or (saved_dtype != wanted and not (
                dtype.is_floating_point and saved_dtype in cast)):
            raise BayesifyError(
                f"posterior tensor {name!r} is {saved_dtype}{list(saved_shape)} in {tensor_path}, "
                f"but the model built from the manifest's config ({manifest['method']!r}) expects "
                f"{SAFETENSORS_DTYPES.get(dtype, dtype)}{list(shape)}: refused before "
                "allocating anything (the manifest or the file was altered)"
            )


def _read_tensor_file(directory: Path, manifest: dict[str, Any], base_model: nn.Module,
                      expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None,
                      ) -> tuple[dict[str, Any], bytes, Path]:
    """The committed tensor file's bytes, its header checked (names, the dry run's shapes,
    saved base tensors against ``base_model``) before its data is read."""
    from bayesify.posterior_commit import read_committed

    base_shapes = {k: tuple(v.shape) for k, v in base_model.state_dict().items()}

    def check_header(header: dict[str, tuple[str, tuple[int, ...]]], path: Path) -> None:
        check_against_header(manifest, header, expected, path)
        for key in manifest.get("base_tensors") or []:
            name = key[len(BASE_PREFIX):]
            if header[key][1] != base_shapes.get(name, header[key][1][:0] + (-1,)):
                raise BayesifyError(f"{path}: saved base tensor {name!r} does not fit the base "
                                    "model; refused before reading the file's data")

    committed, data, path = read_committed(directory, check_header=check_header)
    if committed != manifest:
        raise _ManifestReplaced(f"{directory / MANIFEST_FILE} was replaced while it was "
                                "loaded (a concurrent save); load it again")
    return committed, data, path


class _ManifestReplaced(BayesifyError):
    """A concurrent save committed a new manifest during a load: start the load again."""


#: loads started again when concurrent saves keep replacing the manifest
_LOAD_ATTEMPTS = 4


def load_posterior(base_model: nn.Module, directory: str | os.PathLike, *,
                   output_fn: Any = None, key: str | bytes | None = None,
                   old_temperature: str = "refuse") -> BayesianModel:
    """Rebuild the saved posterior around ``base_model`` (copied) and load it strictly.

    Raises :class:`BayesifyError` when the manifest is malformed, the base weights
    differ from those the posterior was fitted on, the tensor file was altered,
    or tensors are missing, extra or of the wrong shape / dtype. Shapes implied
    by the manifest's config are compared with the tensor file's header on a
    meta-device dry run *before* anything is allocated. The dtypes the model had
    when it was saved (``.half()``, ``.double()``) are restored. ``output_fn``: the
    function the posterior was fitted with when it was a callable (a name or index
    is stored in the manifest and re-applied without it). ``key``: the posterior must
    carry an HMAC signature made with this key (``save_posterior(dir, key=...)``).
    Sizes are checked against the manifest and the file's own header before the
    tensor data is read; the data is read once, in blocks, and hashed.

    The saved temperature acts on the predictive (``softmax(log p̄ / T)``; manifest key
    ``temperature_kind: "predictive"``). A posterior saved before that (no key) whose
    temperature is not 1 divided the members' logits — a different predictive — and is
    refused; ``old_temperature="reset"`` loads it at temperature 1 (then re-run ``tune`` or
    ``calibrate``). At temperature 1 both kinds are the same predictive and load as is.
    """
    for attempt in range(_LOAD_ATTEMPTS):
        try:
            # a shared lock: a save (which holds the directory's exclusive lock while it
            # commits) never replaces the manifest between the reads of one load; the
            # retries remain for file systems without flock
            with directory_lock(directory, shared=True, missing_ok=True):
                return _load_posterior(base_model, directory, output_fn=output_fn,
                                       signing_key=key, old_temperature=old_temperature)
        except _ManifestReplaced:
            if attempt == _LOAD_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _load_posterior(base_model: nn.Module, directory: str | os.PathLike, *, output_fn: Any,
                    signing_key: str | bytes | None,
                    old_temperature: str = "refuse") -> BayesianModel:
    from safetensors import SafetensorError
    from safetensors.torch import load as deserialise

    from bayesify.core.factory import bayesify, parallel_module
    from bayesify.core.registry import get_method_class

    base_model = parallel_module(base_model)
    directory = Path(directory)
    manifest = read_manifest(directory)
    verify_signature(manifest, signing_key, directory / MANIFEST_FILE)
    base_print = fingerprint(base_model.state_dict())
    if base_print not in (manifest["base_fingerprint"], manifest.get("base_fingerprint_saved")):
        _explain_other_base(base_model, manifest)
        raise BayesifyError(
            f"the base model ({type(base_model).__name__}, weights fingerprint {base_print[:12]}…) "
            f"is not the one this posterior was fitted on ({manifest.get('base_model')}, "
            f"{manifest['base_fingerprint'][:12]}…); pass the same architecture with the same "
            "weights (and save the base model too if its weights were fine-tuned)"
        )
    check_architecture(manifest, base_model, directory / MANIFEST_FILE)
    method = manifest["method"]
    try:
        config_cls = get_method_class(method).config_cls
        config = config_cls.from_kwargs(method, config_cls.saved_defaults(dict(manifest["config"])))
    except (BayesifyError, TypeError) as err:
        raise BayesifyError(f"{directory / MANIFEST_FILE}: its config is not valid ({err})") from err
    spec = _output_fn_to_load(manifest, output_fn, directory / MANIFEST_FILE)
    manifest, data, tensor_path = _read_tensor_file(directory, manifest, base_model,
                                                    _dry_run_shapes(base_model, method, config))
    bnn = bayesify(base_model, method, config=config, output_fn=spec)
    if list(bnn.targets) != list(manifest["targets"]):
        raise BayesifyError(f"re-bayesifying wrapped {bnn.targets[:5]}… but the posterior was "
                            f"saved for {manifest['targets'][:5]}…")
    if "dtypes" in manifest:
        restore_dtypes(bnn, manifest["dtypes"], directory / MANIFEST_FILE)
    try:
        tensors = deserialise(data)
    except (SafetensorError, OSError, ValueError) as err:
        raise BayesifyError(f"cannot read {tensor_path}: {err}") from err
    bad = unusable_tensors(tensors)
    if bad:
        raise BayesifyError(f"{tensor_path} holds NaN/inf in {bad[:5]}; it is not a posterior "
                            "to predict with")
    base_names = set(manifest.get("base_tensors", []))
    with torch.no_grad():
        base = bnn.base_state_dict()
        for key in sorted(base_names):
            name = key[len(BASE_PREFIX):]
            if name not in base or key not in tensors or tensors[key].shape != base[name].shape:
                raise BayesifyError(f"{tensor_path}: saved base tensor {name!r} does not fit "
                                    "the base model")
            base[name].copy_(tensors[key])
    laplace_heads.restore(bnn, tensors)  # the heads' entries exist only once fitted
    expected = dict(bnn.named_posterior_parameters())
    expected.update(dict(bnn.named_posterior_buffers()))
    _load_tensors(bnn, expected, {k: v for k, v in tensors.items() if k not in base_names})
    _check_temperature_kind(bnn, manifest, old_temperature, directory / MANIFEST_FILE)
    bnn.eval()
    return bnn


#: where a saved temperature acts (see load_posterior)
TEMPERATURE_KIND = "predictive"


def _check_temperature_kind(bnn: BayesianModel, manifest: dict[str, Any], old: str,
                            where: Path) -> None:
    """Refuse (or, ``old="reset"``, reset to 1) a temperature of the older member-logit kind;
    restore who chose the temperature."""
    if old not in ("refuse", "reset"):
        raise BayesifyError(f"old_temperature must be 'refuse' or 'reset', got {old!r}")
    kind = manifest.get("temperature_kind")
    if kind not in (None, TEMPERATURE_KIND):
        raise BayesifyError(f"{where}: unknown temperature_kind {kind!r}; this bayesify reads "
                            f"{TEMPERATURE_KIND!r} (is the posterior from a newer version?)")
    source = manifest.get("temperature_source", "default")
    bnn.temperature_source = source if source in ("default", "search", "calibrate") else "default"
    saved = bnn.state.value("temperature")
    if kind is None and saved != 1.0:
        if old == "refuse":
            raise BayesifyError(
                f"{where}: this posterior was saved by an older bayesify with temperature "
                f"T = {saved:.4g} dividing the members' logits (or the Gaussian's moments); the "
                "temperature now acts on the predictive's log-probabilities, softmax(log p̄ / T), "
                "a different predictive, so it is not reinterpreted. Load it with "
                "load_posterior(base_model, dir, old_temperature='reset') (temperature 1) and "
                "re-run bayesify.tune(bnn, val_loader) or calibrate, then save it again")
        bnn.state.set("temperature", 1.0)
        bnn.temperature_source = "default"


def head_classes(model: nn.Module) -> int | None:
    """Outputs of ``model``'s classifier (:func:`~bayesify.core.walker.find_classifier`), or
    None when it has none the walker recognises."""
    from bayesify.core.walker import find_classifier

    name = find_classifier(model)
    if name is None:
        return None
    head = model.get_submodule(name)
    return int(getattr(head, "out_features", getattr(head, "out_channels", 0))) or None


def _explain_other_base(base_model: nn.Module, manifest: dict[str, Any]) -> None:
    """The two mistakes behind most fingerprint mismatches, said plainly: the wrapped model
    passed instead of the base, and a head with another class count."""
    from bayesify.core.layers import BayesianLayer
    from bayesify.core.model import BayesianModel

    if isinstance(base_model, BayesianModel) or any(
            isinstance(m, BayesianLayer) for m in base_model.modules()):
        raise BayesifyError(
            "load_posterior takes the base network, not a bayesified one: pass the base model "
            "(`bnn.unwrap()`, or the pretrained network as you built it before bayesify)")
    saved = manifest.get("num_classes")
    if isinstance(saved, int) and not isinstance(saved, bool):
        given = head_classes(base_model)
        if given is not None and given != saved:
            raise BayesifyError(
                f"the head has {given} classes, the posterior {saved}: load it onto the network "
                f"it was fitted on (a classifier with {saved} outputs, the same weights)")


def _output_fn_to_load(manifest: dict[str, Any], given: Any, where: Path) -> Any:
    """The ``output_fn`` to rebuild with: the stored name / index, or the callable the
    caller passes for a posterior fitted with one (mismatches are refused)."""
    if "output_fn" not in manifest:  # written before output_fn existed
        return given
    stored = manifest["output_fn"]
    if isinstance(stored, dict):
        if given is None or isinstance(given, (str, int)):
            raise BayesifyError(
                f"{where}: this posterior was fitted with output_fn={stored.get('callable')} "
                "(a function, which a file cannot hold); pass it again: "
                "load_posterior(base_model, dir, output_fn=...)")
        return given
    if given is not None and given != stored:
        raise BayesifyError(f"{where}: the posterior was fitted with output_fn={stored!r}, "
                            f"not {given!r}; leave output_fn out to use the stored one")
    return stored


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
