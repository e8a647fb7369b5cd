"""Running an exported predictor: ``load_exported`` / ``run_exported``.

::

    exported = load_exported("bnn.onnx")            # checks bnn.onnx.sha256 first
    exported.metadata["class_names"], exported.metadata["preprocessing"]
    out = exported(exported.preprocess(pil_images))  # resize / crop / normalise as recorded
    out.probs, out.epistemic, out.predicted_names()

    probs, epistemic = run_exported("bnn.pt2", x)   # one call; the same checks

Both formats are read through :func:`~bayesify.predict.export_trust.read_verified`
(the sha256 record must match) and a ``.pt2`` through
:func:`~bayesify.predict.export_trust.check_pt2_archive` before ``torch.export.load``
parses it, so nothing in the file is unpickled or evaluated. ONNX runs on
onnxruntime (CPU); ``.pt2`` on torch, on the inputs' device.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any, Self

import torch

from bayesify.core.batch import Batch
from bayesify.errors import BayesifyError
from bayesify.predict.export_inputs import InputLayout, example_batch
from bayesify.predict.export_meta import METADATA_NAME
from bayesify.predict.export_trust import check_pt2_archive, read_verified
from bayesify.predict.preprocessing import apply_preprocessing

FORMATS = ("pt2", "onnx")


def format_of(path: str | Path, format: str | None = None) -> str:
    """The export format named by ``path``'s suffix; ``format`` must agree with it."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if format is not None and format not in FORMATS:
        raise BayesifyError(f"unknown export format {format!r}; use one of {FORMATS}")
    if suffix not in FORMATS:
        raise BayesifyError(f"cannot tell the export format from {Path(path).name!r}: name the "
                            "file .pt2 (torch.export) or .onnx (ONNX)")
    if format is not None and format != suffix:
        raise BayesifyError(f"format={format!r} but the file is named {Path(path).name!r}: "
                            f"a .{suffix} file holds the {suffix} format; rename it or drop format=")
    return suffix


class ExportedOutput(tuple):
    """``(probs [B, C], epistemic [B])`` of an exported predictor, with its ``metadata``."""

    def __new__(cls, probs: torch.Tensor, epistemic: torch.Tensor,
                metadata: dict[str, Any]) -> Self:
        out = super().__new__(cls, (probs, epistemic))
        out.metadata = metadata
        return out

    @property
    def probs(self) -> torch.Tensor:
        return self[0]

    @property
    def epistemic(self) -> torch.Tensor:
        return self[1]

    @property
    def class_names(self) -> list[str] | None:
        return self.metadata.get("class_names")

    def predicted_names(self) -> list[str]:
        """The most probable class of every row, by name (its index when none is recorded)."""
        names = self.class_names
        return [names[i] if names else str(i) for i in self.probs.argmax(-1).tolist()]


def _batch(inputs: tuple[Any, ...], named: dict[str, Any]) -> Batch:
    if len(inputs) == 1 and not named:
        batch = example_batch(inputs[0])
    elif inputs or named:
        batch = Batch(tuple(inputs), dict(named), None)
    else:
        raise BayesifyError("an exported predictor needs the inputs it was exported with")
    return Batch(tuple(a.detach() for a in batch.args),
                 {k: v.detach() for k, v in batch.kwargs.items() if isinstance(v, torch.Tensor)})


def _numpy_input(t: torch.Tensor) -> Any:
    t = t.detach().cpu()
    if t.is_floating_point():
        t = t.float()
    elif t.dtype != torch.bool:
        t = t.long()
    return t.numpy()


class LoadedExport:
    """An exported predictor read from disk: call it like the program, read ``metadata``,
    ``preprocess`` raw images as recorded."""

    def __init__(self, path: str | Path, *, check_sha256: bool = True) -> None:
        self.path = Path(path)
        self.format = format_of(self.path)
        data = read_verified(self.path, check_sha256=check_sha256)
        if self.format == "onnx":
            self._session, self.metadata = _onnx_session(data)
        else:
            check_pt2_archive(data, self.path)
            self._module, self.metadata = _pt2_module(data)

    @property
    def class_names(self) -> list[str] | None:
        return self.metadata.get("class_names")

    @property
    def preprocessing(self) -> dict[str, Any] | None:
        return self.metadata.get("preprocessing")

    def preprocess(self, images: Any) -> torch.Tensor:
        """``[B, C, H, W]`` input from PIL images / image tensors by the recorded steps."""
        return apply_preprocessing(self.preprocessing, images)

    def __call__(self, *inputs: Any, **named: Any) -> ExportedOutput:
        batch = _batch(inputs, named)
        layout = InputLayout.of(batch)
        if self.format == "onnx":
            wanted = [i.name for i in self._session.get_inputs()]
            given = dict(zip(layout.names, layout.tensors(batch)))
            if len(wanted) == 1 and len(given) == 1:  # files written before inputs were named
                given = {wanted[0]: next(iter(given.values()))}
            missing = [n for n in wanted if n not in given]
            if missing:
                raise BayesifyError(f"the ONNX program takes inputs {wanted}; missing {missing}")
            probs, epistemic = self._session.run(None, {n: _numpy_input(given[n]) for n in wanted})
            return ExportedOutput(torch.from_numpy(probs), torch.from_numpy(epistemic),
                                  self.metadata)
        args, kwargs = layout.call_inputs(batch)
        with torch.no_grad():
            probs, epistemic = self._module(*args, **kwargs)
        return ExportedOutput(probs, epistemic, self.metadata)


def _onnx_session(data: bytes) -> tuple[Any, dict[str, Any]]:
    try:
        import onnxruntime
    except ImportError as err:
        raise BayesifyError("running an ONNX export needs onnxruntime: "
                            "pip install 'bayesify[export]'") from err
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    record = session.get_modelmeta().custom_metadata_map.get("bayesify")
    return session, (json.loads(record) if record else {})


def _pt2_module(data: bytes) -> tuple[torch.nn.Module, dict[str, Any]]:
    extra: dict[str, Any] = {METADATA_NAME: ""}
    quiet = logging.getLogger("torch.export")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        program = torch.export.load(io.BytesIO(data), extra_files=extra)
    finally:
        quiet.setLevel(level)
    record = extra.get(METADATA_NAME) or ""
    return program.module(), (json.loads(record) if record else {})


def load_exported(path: str | Path, *, check_sha256: bool = True) -> LoadedExport:
    """Read an exported predictor after the integrity and archive checks (module docstring).
    ``check_sha256=False`` skips only the sha256 record (for a file you trust)."""
    return LoadedExport(path, check_sha256=check_sha256)


def run_exported(path: str | Path, *inputs: Any, preprocess: bool = False,
                 check_sha256: bool = True, **named: Any) -> ExportedOutput:
    """``(probs, epistemic)`` of a saved ``.pt2`` (torch, on the inputs' device) or ``.onnx``
    (onnxruntime, CPU), with ``.metadata`` (class names, preprocessing, family, fingerprint).

    Inputs as at export: ``run_exported(path, x)``, ``run_exported(path, mapping)``,
    ``run_exported(path, *tensors)`` or ``run_exported(path, **mapping)``;
    ``preprocess=True``: ``x`` is raw images (PIL or image tensors), prepared by the
    recorded preprocessing first.
    """
    exported = LoadedExport(path, check_sha256=check_sha256)
    if preprocess:
        if len(inputs) != 1 or named:
            raise BayesifyError("preprocess=True takes one input: the images")
        inputs = (exported.preprocess(inputs[0]),)
    return exported(*inputs, **named)
