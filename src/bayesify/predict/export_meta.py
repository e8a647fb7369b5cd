"""What an export says about itself, and where it says it.

An exported predictor carries a metadata record (:func:`export_metadata`)::

    {"bayesify_export": 1, "bayesify_version", "torch_version", "format",
     "method", "members", "temperature", "temperature_kind", "num_classes", "class_names",
     "preprocessing", "inputs", "dynamic_axes", "outputs": ["probs", "epistemic"],
     "posterior_fingerprint", "base_fingerprint"}

``class_names``: given, else those given to the same predictor's previous export, else
the wrapped Hugging Face model's ``config.id2label`` (unless it is the generic ``LABEL_i``),
else ``None``. ``preprocessing``: see
:mod:`bayesify.predict.preprocessing` (``"auto"``: a timm model's own). The
fingerprints are sha256 over the posterior tensors (MAP: the model's state) and
over the base weights as they were wrapped, as in ``save_posterior``.

The record lives inside the file — ``extra/bayesify.json`` of the ``.pt2``
(``torch.export.save(extra_files=...)``) and the ONNX ``metadata_props`` (key
``bayesify``, plus ``class_names`` and ``preprocessing`` on their own) — so the
sha256 record covers it, and beside it as ``FILE.json`` for people and tools that
do not open the archive.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bayesify.errors import BayesifyError
from bayesify.predict.preprocessing import resolve_preprocessing

if TYPE_CHECKING:
    from bayesify.predict.predictor import BasePredictor

METADATA_NAME = "bayesify.json"
METADATA_VERSION = 1
JSON_SUFFIX = ".json"


def _wrapped_model(predictor: BasePredictor) -> torch.nn.Module | None:
    bnn = getattr(predictor, "bnn", None)
    if bnn is not None:
        return bnn.model
    parts = getattr(predictor, "parts", None)
    if parts:
        return _wrapped_model(parts[0])
    models = getattr(predictor, "models", None)
    return models[0] if models else None


def export_method(predictor: BasePredictor, default: str) -> str:
    """The family an export names: the posterior's method, a mixture's parts, else
    ``default``."""
    name = getattr(predictor, "method_name", None)
    if isinstance(name, str):
        return name
    return getattr(getattr(predictor, "bnn", None), "method_name", default)


def default_class_names(predictor: BasePredictor) -> list[str] | None:
    """``config.id2label`` of a Hugging Face model, unless it is the generic LABEL_i."""
    config = getattr(_wrapped_model(predictor), "config", None)
    labels = getattr(config, "id2label", None)
    if not isinstance(labels, dict) or not labels:
        return None
    names = [str(labels[i]) for i in sorted(labels, key=int)]
    return None if names == [f"LABEL_{i}" for i in range(len(names))] else names


def posterior_fingerprint(predictor: BasePredictor) -> tuple[str, str | None]:
    """``(posterior fingerprint, base fingerprint)``; MAP: the model's state, no base."""
    from bayesify.persistence import fingerprint

    bnn = getattr(predictor, "bnn", None)
    if bnn is not None:
        return fingerprint(bnn.posterior_tensors()), bnn.base_fingerprint
    parts = getattr(predictor, "parts", None)
    if parts is not None:  # a MixturePredictor: one digest of its parts', in order
        prints = "|".join(f"{a}:{b}" for a, b in (posterior_fingerprint(p) for p in parts))
        return hashlib.sha256(prints.encode()).hexdigest(), None
    state = {f"{i}.{k}": v for i, m in enumerate(getattr(predictor, "models", []))
             for k, v in m.state_dict().items()}
    return fingerprint(state), None


def export_metadata(predictor: BasePredictor, *, fmt: str, members: int, num_classes: int,
                    inputs: list[str], dynamic_axes: dict[str, list[int]],
                    class_names: Any = None, preprocessing: Any = "auto") -> dict[str, Any]:
    """The metadata record of one export (see the module docstring)."""
    from bayesify.version import __version__

    if class_names is not None:
        names = [str(c) for c in class_names]
    else:  # the names given to this predictor's previous export, else a HF id2label
        names = getattr(predictor, "class_names", None) or default_class_names(predictor)
    if names is not None and len(names) != num_classes:
        raise BayesifyError(f"class_names has {len(names)} entries but the predictor has "
                            f"{num_classes} classes")
    method = export_method(predictor, "map")
    fingerprint, base = posterior_fingerprint(predictor)
    return {
        "bayesify_export": METADATA_VERSION, "bayesify_version": __version__,
        "torch_version": torch.__version__.split("+")[0], "format": fmt, "method": method,
        "members": int(members), "temperature": float(predictor.temperature),
        # softmax(log p̄ / T) on the predictive's log-probabilities (not member logits)
        "temperature_kind": "predictive",
        "num_classes": int(num_classes), "class_names": names,
        "preprocessing": resolve_preprocessing(preprocessing, _wrapped_model(predictor)),
        "inputs": list(inputs), "dynamic_axes": dynamic_axes, "outputs": ["probs", "epistemic"],
        "posterior_fingerprint": fingerprint, "base_fingerprint": base,
    }


def pt2_bytes(program: torch.export.ExportedProgram, metadata: dict[str, Any]) -> bytes:
    """``torch.export.save`` with the metadata as ``extra/bayesify.json``, in memory (the
    archive's root folder does not carry a temporary file's name)."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # torch warns when frozen member tables share one storage; the payload is complete
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        torch.export.save(program, buffer, extra_files={METADATA_NAME: json.dumps(metadata)})
    return buffer.getvalue()


def onnx_bytes(model: Any, metadata: dict[str, Any]) -> bytes:
    """The serialised ONNX ``ModelProto`` with the record in its ``metadata_props``."""
    props = {"bayesify": json.dumps(metadata),
             "class_names": json.dumps(metadata["class_names"]),
             "preprocessing": json.dumps(metadata["preprocessing"]),
             "bayesify_method": metadata["method"],
             "posterior_fingerprint": metadata["posterior_fingerprint"]}
    kept = [p for p in model.metadata_props if p.key not in props]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)
    return model.SerializeToString()


def metadata_text(metadata: dict[str, Any]) -> str:
    """``FILE.json``: the same record beside the file."""
    return json.dumps(metadata, indent=2)


def json_path(path: Path) -> Path:
    return path.with_name(path.name + JSON_SUFFIX)
