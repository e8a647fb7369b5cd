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

Only bayesify exports are run: a program without bayesify's metadata record (a plain
``torch.export.save`` of another model) is refused, and every call checks that the
outputs are ``probs [B, C]`` and ``epistemic [B]`` with the recorded ``C``. Inputs
holding NaN/inf are refused as by the in-process predictor (``nonfinite="propagate"``
lets them through).
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any, Self

import torch

from bayesify.core.batch import Batch, model_ready
from bayesify.errors import BayesifyError
from bayesify.predict.export_inputs import InputLayout, example_batch
from bayesify.predict.export_meta import METADATA_NAME
from bayesify.predict.export_trust import check_pt2_archive, read_verified
from bayesify.predict.preprocessing import apply_preprocessing
from bayesify.predict.serving import check_inputs, check_nonfinite_policy

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
    ``preprocess`` raw images as recorded. ``data``: the file's bytes, already in hand
    (export's own verification); ``nonfinite``: ``"error"`` (default) refuses NaN/inf
    inputs like the in-process predictor, ``"propagate"`` lets them through."""

    def __init__(self, path: str | Path, *, check_sha256: bool = True, data: bytes | None = None,
                 nonfinite: str = "error") -> None:
        self.path = Path(path)
        self.format = format_of(self.path)
        self.nonfinite = check_nonfinite_policy(nonfinite)
        if data is None:
            data = read_verified(self.path, check_sha256=check_sha256)
        if self.format == "onnx":
            self._session, self.metadata = _onnx_session(data, self.path)
        else:
            check_pt2_archive(data, self.path)
            self._module, self.metadata = _pt2_module(data)
        _check_metadata(self.metadata, self.path)

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
        check_inputs(batch, self.nonfinite, where=f"exported predictor {self.path.name}")
        layout = InputLayout.of(batch)
        first = layout.tensors(batch)[0]
        rows = int(first.shape[0]) if first.dim() else -1
        if self.format == "onnx":
            wanted = [i.name for i in self._session.get_inputs()]
            # uint8 images refused with how to convert them, as in process; floats go in as
            # float32 (_numpy_input)
            _, given = model_ready(None, (), dict(zip(layout.names, layout.tensors(batch))))
            if len(wanted) == 1 and len(given) == 1:  # files written before inputs were named
                given = {wanted[0]: next(iter(given.values()))}
            missing = [n for n in wanted if n not in given]
            if missing:
                raise BayesifyError(f"the ONNX program takes inputs {wanted}; missing {missing}")
            outputs = self._session.run(None, {n: _numpy_input(given[n]) for n in wanted})
            outputs = [torch.from_numpy(o) for o in outputs]
        else:
            # floats in the program's own dtype (float64 / float16 inputs), uint8 images
            # refused with how to convert them: the in-process predictor's rule
            args, kwargs = model_ready(self._module, *layout.call_inputs(batch))
            with torch.no_grad():
                outputs = self._module(*args, **kwargs)
        probs, epistemic = _checked_outputs(outputs, rows, self.metadata, self.path)
        return ExportedOutput(probs, epistemic, self.metadata)


def _check_metadata(metadata: Any, path: Path) -> None:
    """A bayesify export records itself; anything else is not run."""
    ok = (isinstance(metadata, dict) and type(metadata.get("bayesify_export")) is int
          and type(metadata.get("num_classes")) is int and metadata["num_classes"] >= 1
          and metadata.get("outputs") == ["probs", "epistemic"])
    if not ok:
        where = "extra/bayesify.json" if path.suffix.lower() == ".pt2" else "metadata_props"
        raise BayesifyError(
            f"{path} is not a bayesify export: it has no valid bayesify metadata record "
            f"({where}), so what its outputs mean is unknown. Run only files written by "
            "predictor.export(...); a plain torch.export / ONNX model of your own is run with "
            "torch.export.load / onnxruntime directly (trusted files only)")


def _checked_outputs(outputs: Any, rows: int, metadata: dict[str, Any],
                     path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [B, C], epistemic [B])`` with the recorded ``C``, or a refusal."""
    classes = metadata["num_classes"]
    is_pair = isinstance(outputs, (tuple, list))
    shapes = ([tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
               for o in outputs] if is_pair else [type(outputs).__name__])
    if not (is_pair and shapes == [(rows, classes), (rows,)]):
        raise BayesifyError(
            f"{path} returned outputs of shapes {shapes}, not the recorded probs [{rows}, "
            f"{classes}] and epistemic [{rows}]: the program is not the export its metadata "
            "describes; refusing its outputs")
    return outputs[0], outputs[1]


def _what_it_is(data: bytes) -> str:
    if data[:2] == b"PK":
        return "it is a zip archive (a .pt2 or torch.save file?)"
    if data[:1] == b"\x80":
        return "it is a Python pickle (torch.save / pickle.dump)"
    return "its bytes are not an ONNX protobuf"


def _onnx_session(data: bytes, path: Path) -> tuple[Any, dict[str, Any]]:
    try:
        import onnxruntime
    except ImportError as err:
        raise BayesifyError("running an ONNX export needs onnxruntime: "
                            "pip install 'bayesify[export]'") from err
    try:
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - onnxruntime raises its own pybind error kinds
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        raise BayesifyError(f"{path} is not an ONNX model: {_what_it_is(data)} (onnxruntime: "
                            f"{first}). Export with predictor.export('model.onnx', x)") from None
    record = session.get_modelmeta().custom_metadata_map.get("bayesify")
    try:
        return session, (json.loads(record) if record else {})
    except ValueError:
        return session, {}


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
    try:
        return program.module(), (json.loads(record) if record else {})
    except ValueError:
        return program.module(), {}


def load_exported(path: str | Path, *, check_sha256: bool = True,
                  nonfinite: str = "error") -> LoadedExport:
    """Read an exported predictor after the integrity and archive checks (module docstring).
    ``check_sha256=False`` skips only the sha256 record (for a file you trust)."""
    return LoadedExport(path, check_sha256=check_sha256, nonfinite=nonfinite)


def run_exported(path: str | Path, *inputs: Any, preprocess: bool = False,
                 check_sha256: bool = True, nonfinite: str = "error",
                 **named: Any) -> ExportedOutput:
    """``(probs, epistemic)`` of a saved ``.pt2`` (torch, on the inputs' device) or ``.onnx``
    (onnxruntime, CPU), with ``.metadata`` (class names, preprocessing, family, fingerprint).

    Inputs as at export: ``run_exported(path, x)``, ``run_exported(path, mapping)``,
    ``run_exported(path, *tensors)`` or ``run_exported(path, **mapping)``;
    ``preprocess=True``: ``x`` is raw images (PIL or image tensors), prepared by the
    recorded preprocessing first.
    """
    exported = LoadedExport(path, check_sha256=check_sha256, nonfinite=nonfinite)
    if preprocess:
        if len(inputs) != 1 or named:
            raise BayesifyError("preprocess=True takes one input: the images")
        inputs = (exported.preprocess(inputs[0]),)
    return exported(*inputs, **named)
