"""Reading an exported predictor without trusting it: integrity record and a
``.pt2`` archive checked before torch parses it.

**Integrity.** Every export gets ``FILE.sha256`` beside it (``sha256sum -c``
format). :func:`read_verified` reads the file's bytes once, compares their sha256
with the record and hands on *those bytes* (no second read a swapped file could
slip into). A missing record or a mismatch (flipped bytes, a truncated copy) is
refused.

**No code from a .pt2.** ``torch.export.load`` may run code from the archive:
pickled weights / constants (``use_pickle``) and custom objects are unpickled with
full ``pickle``; the sample inputs are retried with full unpickling when the safe
load fails; legacy archives unpickle their state dict; AOTInductor packages load
shared libraries; and strings inside ``models/*.json`` are evaluated (symbolic
shapes through ``sympy.sympify``, shape guards compiled to Python, node targets
resolved as any ``torch.*`` attribute). :func:`check_pt2_archive` refuses all of
that before ``torch.export.load`` sees the file:

- records: only the plain layout ``torch.export.save`` writes (raw tensor payloads,
  JSON configs, ``extra/``), one archive root, no duplicates;
- weight / constant configs: no ``use_pickle``, payload names ``weight_N`` /
  ``tensor_N`` only (no custom or opaque objects);
- sample inputs: must load with ``torch.load(weights_only=True)`` (so torch's own
  load never falls back to full unpickling);
- the program JSON: node targets are ATen ops or symbolic-size arithmetic; every
  symbolic expression is a sympy ``srepr`` of integers and size symbols; guards
  compare input sizes only.

ONNX files are protobuf run by onnxruntime: no Python code is loaded from them.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from bayesify.errors import BayesifyError

SHA256_SUFFIX = ".sha256"

#: records of a plain ``torch.export.save`` archive (relative to its root folder)
_RECORD = re.compile(
    r"(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/\w+\.json|data/weights/\w+_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/\w+_constants_config\.json|data/constants/tensor_\d+"
    r"|data/sample_inputs/\w+\.pt|extra/[\w.\-]+)")
#: Python operators a size computation may call (the serializer's _SYM_OPS)
_OPERATORS = {"getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos",
              "eq", "ne", "le", "ge", "lt", "gt", "and_", "or_", "not_"}
_SYM_TARGET = re.compile(r"torch\.(sym_\w+|_sym_sqrt)|math\.(trunc|floor|ceil|sqrt)")
_ATEN_TARGET = re.compile(r"torch\.ops\.(aten|prims)\.\w+\.\w+")
#: a sympy srepr of integer arithmetic on size symbols
_SREPR_NAMES = {"Symbol", "Integer", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Mod",
                "FloorDiv", "CeilDiv", "PythonMod", "CleanDiv", "FloorToInt", "CeilToInt",
                "TruncToInt", "IntTrueDiv", "PowByNatural", "Eq", "Ne", "Le", "Lt", "Ge", "Gt",
                "And", "Or", "Not", "true", "false", "True", "False", "positive", "integer",
                "nonnegative", "finite", "real", "oo", "zoo", "nan", "S", "Infinity",
                "NegativeInfinity", "One", "Zero", "NegativeOne"}
_SREPR_TOKEN = re.compile(r"'[a-z]+\d+'|[A-Za-z_]\w*|\d+|[(),=+\-*/ ]")
_GUARD_SIZE = re.compile(r"L\['\w+'\]\.(size|stride)\(\)\[\d+\]")
_GUARD_REST = re.compile(r"[\d\s()+\-*/%<>=!]|and|or|not")


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: Path) -> Path:
    return path.with_name(path.name + SHA256_SUFFIX)


def write_sha256(path: Path, digest: str, *, name: str | None = None) -> Path:
    """``FILE.sha256`` holding ``"<hex>  <name>"`` (``sha256sum -c`` checks it)."""
    record = sha256_path(path)
    record.write_text(f"{digest}  {name or path.name}\n")
    return record


def read_verified(path: Path, *, check_sha256: bool = True) -> bytes:
    """The bytes of ``path``, checked against ``FILE.sha256`` (see the module docstring)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise BayesifyError(f"cannot read the export {path}: {err}") from err
    if not check_sha256:
        return data
    record = sha256_path(path)
    if not record.is_file():
        raise BayesifyError(
            f"{path} has no integrity record {record.name} beside it, so its content cannot be "
            "checked; keep the .sha256 written by export with the file, or pass "
            "check_sha256=False for a file you trust (the archive checks still apply)")
    expected = record.read_text().split()[0].lower() if record.read_text().split() else ""
    actual = sha256_of(data)
    if actual != expected:
        raise BayesifyError(
            f"{path} does not match its integrity record {record.name} (sha256 {actual[:16]}… "
            f"≠ {expected[:16]}…): the file was changed or damaged after export; refusing it")
    return data


# -- the .pt2 archive -------------------------------------------------------------------------
def _refuse(path: Path, why: str) -> BayesifyError:
    return BayesifyError(f"refusing {path}: {why}. bayesify loads only the plain archives "
                         "torch.export.save writes (no pickled objects, no compiled code)")


def _records(data: bytes, path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile as err:
        raise _refuse(path, f"not a .pt2 archive ({err})") from None
    roots = {name.split("/", 1)[0] for name in names}
    if len(roots) != 1 or len(set(names)) != len(names) or any("/" not in n for n in names):
        raise _refuse(path, "the archive has several roots or duplicate records")
    records = [name.split("/", 1)[1] for name in names]
    odd = [r for r in records if not _RECORD.fullmatch(r)]
    if odd:
        raise _refuse(path, f"it holds records a plain export never has: {odd[:5]}")
    return records


def _walk(value: Any, key: str = "") -> Any:
    """``(key, value)`` for every dict entry in a JSON tree."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k, v
            yield from _walk(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v, key)


def _check_target(target: str, path: Path) -> None:
    if _ATEN_TARGET.fullmatch(target) or _SYM_TARGET.fullmatch(target):
        return
    if target.startswith("_operator.") and target.split(".", 1)[1] in _OPERATORS:
        return
    raise _refuse(path, f"its graph calls {target!r}, which is not an ATen operator")


def _check_expression(text: str, path: Path) -> None:
    tokens = _SREPR_TOKEN.findall(text)
    names = [t for t in tokens if t[0].isalpha() or t[0] == "_"]
    if "".join(tokens) != text or any(n not in _SREPR_NAMES for n in names):
        raise _refuse(path, f"a symbolic shape is not plain size arithmetic: {text[:80]!r}")


def _check_guard(text: str, path: Path) -> None:
    rest = _GUARD_SIZE.sub(" ", text)
    if "".join(_GUARD_REST.findall(rest)) != rest:
        raise _refuse(path, f"a shape guard is not a size comparison: {text[:80]!r}")


def _check_program(program: Any, path: Path) -> None:
    for key, value in _walk(program):
        if key == "target" and isinstance(value, str):
            _check_target(value, path)
        elif key == "expr_str":
            _check_expression(str(value), path)
        elif key == "range_constraints" and isinstance(value, dict):
            for symbol in value:
                if not re.fullmatch(r"[a-z]+\d+", str(symbol)):
                    raise _refuse(path, f"a size symbol is named {symbol!r}")
        elif key == "guards_code":
            for guard in value or []:
                _check_guard(str(guard), path)


def check_pt2_archive(data: bytes, path: Path) -> None:
    """Refuse anything in a ``.pt2`` that ``torch.export.load`` would execute (module docstring)."""
    from torch.export.pt2_archive._package import PT2ArchiveReader

    records = _records(data, path)
    if "archive_format" not in records or not any(r.startswith("models/") for r in records):
        raise _refuse(path, "it is not a torch.export archive (no archive_format / models/)")
    try:
        reader = PT2ArchiveReader(io.BytesIO(data))
    except Exception as err:  # noqa: BLE001 - torch raises several kinds for broken archives
        raise _refuse(path, f"torch cannot read it as a .pt2 archive ({err})") from None
    if sorted(reader.get_file_names()) != sorted(records):
        raise _refuse(path, "zip readers disagree about its records")
    for record in records:
        payload = reader.read_bytes(record)
        if record.endswith("_config.json"):
            prefix = "weight_" if record.startswith("data/weights/") else "tensor_"
            for name, entry in json.loads(payload).get("config", {}).items():
                if entry.get("use_pickle") or not re.fullmatch(rf"{prefix}\d+",
                                                               str(entry.get("path_name"))):
                    raise _refuse(path, f"tensor {name!r} is stored as a pickled object")
        elif record.startswith("models/"):
            _check_program(json.loads(payload), path)
        elif record.startswith("data/sample_inputs/"):
            try:  # torch tries weights_only=True first: if this loads, it never falls back
                torch.load(io.BytesIO(payload), weights_only=True)
            except Exception as err:  # noqa: BLE001 - any failure means "not weights-only"
                first = str(err).strip().splitlines()[0][:120] if str(err).strip() else ""
                raise _refuse(path, f"its sample inputs need full unpickling ({first})") from None
