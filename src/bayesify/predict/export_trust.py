"""Writing an export as one commit, and reading it without trusting it: integrity
record and a ``.pt2`` archive checked before torch parses it.

**One commit.** An export is three files: ``FILE`` (the program), ``FILE.json`` (its
metadata) and ``FILE.sha256`` (``sha256sum -c`` format, one line per file:
``<sha> FILE`` and ``<sha> FILE.json``). :func:`commit_export` makes them visible
together; the record is the commit point, as a posterior's manifest is (all under an
exclusive ``flock`` of the directory, so concurrent exports to one path take turns
and the last one wins whole):

1. finish an interrupted earlier commit of ``FILE`` and delete its leftover
   temporary files (only names carrying :mod:`bayesify.atomic_files`' marker);
2. write the program to ``.FILE.<sha16>-<random>.pending``, the metadata to
   ``.FILE.json.<sha16>-<random>.pending`` and the new record to
   ``.FILE.sha256-<random>.tmp`` (fresh ``O_EXCL | O_NOFOLLOW`` names, fsync'ed);
3. rename the record onto ``FILE.sha256`` — **the commit**;
4. rename the program onto ``FILE`` and the metadata onto ``FILE.json``.

A failure or kill before 3 leaves the previous export (all three files) untouched;
after 3, :func:`read_verified` finds the new program in its pending file by the
recorded sha256 (and finishes the renames when it can write the directory; the next
export always does). Nothing is ever written through a symlink: renames replace a
link, never its target.

**Integrity.** :func:`read_verified` reads the file's bytes once, compares their sha256
with the record and hands on *those bytes* (no second read a swapped file could
slip into). A missing record or a mismatch (flipped bytes, a truncated copy) is
refused. Records of older exports (one line) are still read.

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

import glob
import hashlib
import io
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from bayesify.atomic_files import (
    directory_lock,
    file_sha256,
    fsync_directory,
    is_own_temp,
    replace,
    write_temp,
)
from bayesify.errors import BayesifyError

SHA256_SUFFIX = ".sha256"
JSON_SUFFIX = ".json"
#: an integrity record is two short lines; anything far larger is not one
MAX_RECORD_BYTES = 1 << 16
#: times a reader looks again when a concurrent export replaced the files under it
_READ_ATTEMPTS = 4

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


def _json_path(path: Path) -> Path:
    return path.with_name(path.name + JSON_SUFFIX)


def write_sha256(path: Path, digest: str, *, name: str | None = None) -> Path:
    """``FILE.sha256`` holding ``"<hex>  <name>"`` (``sha256sum -c`` checks it), written
    atomically under a fresh name and renamed into place (never through a symlink)."""
    record = sha256_path(path)
    staged = write_temp(path.parent, f"{digest}  {name or path.name}\n".encode(),
                        prefix=f".{path.name}.sha256-", suffix=".tmp")
    replace(staged, record)
    return record


def read_record(record: Path) -> list[tuple[str, str]]:
    """``[(file name, sha256 hex)]`` of an integrity record (``sha256sum`` lines)."""
    try:
        with record.open("rb") as fh:
            text = fh.read(MAX_RECORD_BYTES + 1)
    except OSError as err:
        raise BayesifyError(f"cannot read the integrity record {record}: {err}") from err
    lines = []
    try:
        for line in text.decode().splitlines():
            parts = line.split(maxsplit=1)
            if parts and re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
                lines.append(((parts[1] if len(parts) > 1 else "").lstrip("*"), parts[0].lower()))
    except UnicodeDecodeError:
        lines = []
    if not lines or len(text) > MAX_RECORD_BYTES:
        raise BayesifyError(f"{record} is not an integrity record (sha256sum lines); it is "
                            "damaged: export again")
    return lines


def _recorded(lines: list[tuple[str, str]], name: str, *, metadata: bool) -> str | None:
    """The digest recorded for ``name``; for an export renamed with its record, the first
    line for a program (``metadata=False``) or for a ``.json`` (``metadata=True``)."""
    for recorded_name, digest in lines:
        if recorded_name == name:
            return digest
    for recorded_name, digest in lines:
        if recorded_name.endswith(JSON_SUFFIX) == metadata:
            return digest
    return None


# -- the commit -------------------------------------------------------------------------------
def _pending_prefix(path: Path, sha: str, *, metadata: bool) -> str:
    return f".{path.name}{JSON_SUFFIX if metadata else ''}.{sha[:16]}-"


def _is_export_temp(path: Path, name: str) -> bool:
    base = re.escape(f".{path.name}")
    return (is_own_temp(name, re.compile(base + r"(\.json)?\.[0-9a-f]{16}-"), ".pending")
            or is_own_temp(name, f".{path.name}.sha256-", ".tmp"))


def _pending(path: Path, sha: str, *, metadata: bool = False) -> list[Path]:
    pattern = glob.escape(_pending_prefix(path, sha, metadata=metadata)) + "*.pending"
    return sorted(path.parent.glob(pattern))


def _settle(path: Path) -> None:
    """Step 1 of the module docstring (the caller holds the directory's lock)."""
    leftovers = [p for p in path.parent.iterdir() if _is_export_temp(path, p.name)]
    if not leftovers:
        return
    try:
        lines = read_record(sha256_path(path)) if sha256_path(path).is_file() else []
    except BayesifyError:
        lines = []
    if lines:
        for target, metadata in ((path, False), (_json_path(path), True)):
            sha = _recorded(lines, target.name, metadata=metadata)
            if sha is None or file_sha256(target) == sha:
                continue
            for candidate in _pending(path, sha, metadata=metadata):
                if _is_export_temp(path, candidate.name) and file_sha256(candidate) == sha:
                    replace(candidate, target)
                    break
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)


def _finish_interrupted(path: Path) -> None:
    """Best effort: a reader that found the program in its pending file completes the
    renames (a read-only directory stays as it is; the next export completes them)."""
    try:
        with directory_lock(path.parent):
            _settle(path)
    except OSError:
        pass


def _complete_metadata(path: Path, lines: list[tuple[str, str]]) -> None:
    """A commit interrupted after the program's rename leaves ``FILE.json`` pending:
    finish it, so the metadata beside the file is the program's."""
    sha = _recorded(lines, _json_path(path).name, metadata=True)
    if (sha is not None and _pending(path, sha, metadata=True)
            and file_sha256(_json_path(path)) != sha):
        _finish_interrupted(path)


def commit_export(path: Path, program: bytes, metadata_text: str) -> list[Path]:
    """Steps 1–4 of the module docstring; returns ``[FILE, FILE.json, FILE.sha256]``."""
    files = [path, _json_path(path), sha256_path(path)]
    for target in files:
        if target.is_dir() and not target.is_symlink():
            raise BayesifyError(f"{target} is a directory; an export needs that name for a file")
    metadata = metadata_text.encode()
    program_sha, metadata_sha = sha256_of(program), sha256_of(metadata)
    record = f"{program_sha}  {path.name}\n{metadata_sha}  {files[1].name}\n".encode()
    parent = path.parent
    with directory_lock(parent):
        _settle(path)
        written: list[Path] = []
        try:
            written.append(write_temp(parent, program, prefix=_pending_prefix(
                path, program_sha, metadata=False), suffix=".pending"))
            written.append(write_temp(parent, metadata, prefix=_pending_prefix(
                path, metadata_sha, metadata=True), suffix=".pending"))
            written.append(write_temp(parent, record, prefix=f".{path.name}.sha256-",
                                      suffix=".tmp"))
            fsync_directory(parent)
            replace(written[2], files[2])  # the commit
        except BaseException:
            committed = file_sha256(files[2]) == sha256_of(record)
            for temporary in written[2:] if committed else written:
                temporary.unlink(missing_ok=True)
            raise
        replace(written[0], path)
        replace(written[1], files[1])
    return files


def read_verified(path: Path, *, check_sha256: bool = True) -> bytes:
    """The bytes of ``path``, checked against ``FILE.sha256`` (see the module docstring)."""
    if not check_sha256:
        try:
            return path.read_bytes()
        except OSError as err:
            raise BayesifyError(f"cannot read the export {path}: {err}") from err
    record = sha256_path(path)
    if not record.is_file():
        raise BayesifyError(
            f"{path} has no integrity record {record.name} beside it, so its content cannot be "
            "checked; keep the .sha256 written by export with the file, or pass "
            "check_sha256=False for a file you trust (the archive checks still apply)")
    problem = ""
    for _ in range(_READ_ATTEMPTS):
        lines = read_record(record)
        expected = _recorded(lines, path.name, metadata=False) or ""
        try:
            wrong_size = _wrong_size(path, lines)
            data, actual = (None, "") if wrong_size else _read_if_recorded(path, expected)
        except FileNotFoundError:
            data, problem = None, f"cannot read the export {path}: it does not exist"
        except OSError as err:
            raise BayesifyError(f"cannot read the export {path}: {err}") from err
        else:
            if wrong_size:
                problem = wrong_size
            elif data is not None:
                _complete_metadata(path, lines)
                return data
            else:
                problem = (f"{path} does not match its integrity record {record.name} "
                           f"(sha256 {actual[:16]}… ≠ {expected[:16]}…): the file was changed "
                           "or damaged after export; refusing it")
        for candidate in _pending(path, expected):  # committed, not yet renamed into place
            try:
                data, _ = _read_if_recorded(candidate, expected)
            except OSError:
                continue
            if data is not None:
                _finish_interrupted(path)
                return data
    raise BayesifyError(problem)


#: FILE.json is a small record; a larger one is not read (its size is checked first)
_MAX_METADATA_BYTES = 16 << 20


def _wrong_size(path: Path, lines: list[tuple[str, str]]) -> str:
    """Why ``path`` is refused when its size is not the ``program_bytes`` that its committed
    ``FILE.json`` records — decided before a byte of it is read or hashed; ``""`` otherwise.
    Exports written before the field existed (or whose FILE.json is not the committed one:
    an interrupted commit) are hashed as before."""
    meta = _json_path(path)
    expected = _recorded(lines, meta.name, metadata=True)
    try:
        if expected is None or meta.stat().st_size > _MAX_METADATA_BYTES:
            return ""
        raw = meta.read_bytes()
    except OSError:
        return ""
    if sha256_of(raw) != expected:
        return ""
    try:
        recorded = json.loads(raw).get("program_bytes")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(recorded, int) or isinstance(recorded, bool):
        return ""
    size = path.stat().st_size
    if size == recorded:
        return ""
    return (f"{path} is {size} bytes but its committed record {meta.name} says the exported "
            f"program is {recorded} bytes: the file was replaced or damaged after export; "
            "refusing it without reading it (export again, or restore the file)")


#: files larger than this are hashed in blocks before they are read into memory
_HASH_FIRST_BYTES = 256 << 20


def _read_if_recorded(path: Path, expected: str) -> tuple[bytes | None, str]:
    """``(bytes, sha256)`` of ``path`` when it hashes to ``expected``, else ``(None, sha256)``.
    A large file is hashed in blocks first, so a wrong one (a 64 GiB sparse file) is
    refused without being held in memory; only a matching one is read (and hashed again:
    what is returned is what was checked)."""
    if path.stat().st_size > _HASH_FIRST_BYTES:
        actual = file_sha256(path)
        if actual != expected:
            return None, actual or "unreadable"
    data = path.read_bytes()
    actual = sha256_of(data)
    return (data if actual == expected else None), actual


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
