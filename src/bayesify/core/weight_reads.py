"""Which children a module computes with by reading their weights instead of calling them.

A wrapper on such a child is bypassed: Hugging Face's WavLM attention hands
``self.q_proj.weight`` … to ``F.multi_head_attention_forward``, timm's BEiT / EVA / Swin V2
attention computes ``F.linear(x, self.qkv.weight, qkv_bias)``; families with a mean weight
then compute with it silently (no spread there), the others fail in their first forward.

Found in the source (``ast``) of ``forward`` and the methods it calls, transitively, on the
branches this module takes: a branch test that depends only on the module's attributes and
the method's parameter defaults is evaluated (``if self.q_bias is not None`` — Swin V2 with
its q/v biases reads; ``if query_states is None`` — DeBERTa's attention calls ``in_proj``
unless a caller hands it query states; ``if self.pretraining_tp > 1`` — BLOOM reads only
for tensor-parallel checkpoints); any other test counts both branches. Reads of metadata
(``.dtype``, ``.shape`` …), tests (``is None``, ``isinstance``) and assignments do not count.
Classes of ``torch`` itself are left to :data:`bayesify.core.walker.WEIGHT_READING_PARENTS`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

from torch import nn

_UNKNOWN = object()
#: attributes of a weight that read its metadata, not its values
_META = {"dtype", "device", "shape", "size", "ndim", "dim", "numel", "requires_grad",
         "data_ptr", "is_cuda", "is_meta", "is_contiguous", "is_floating_point", "layout"}
_TESTS = {"isinstance", "hasattr", "getattr", "type", "id", "len", "callable"}


@functools.cache
def _methods(cls: type) -> dict[str, tuple[ast.FunctionDef, str, dict[int, ast.AST]]]:
    """Method name → (its syntax tree, the defining class's name, child → parent map), for
    ``cls`` and its bases outside torch (a subclass's definition wins)."""
    out: dict[str, tuple[ast.FunctionDef, str, dict[int, ast.AST]]] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] in ("torch", "builtins", "typing"):
            continue
        for attr, value in vars(klass).items():
            func = getattr(value, "__func__", value)
            if not inspect.isfunction(func):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
            except (OSError, TypeError, SyntaxError, IndentationError):
                continue
            node = tree.body[0] if tree.body else None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                parents = {id(child): parent for parent in ast.walk(node)
                           for child in ast.iter_child_nodes(parent)}
                out[attr] = (node, klass.__name__, parents)
    return out


def _defaults(fn: ast.FunctionDef) -> dict[str, Any]:
    """Parameters with a literal default that the body never reassigns."""
    args = fn.args
    pairs = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    stored = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)}
    out = {}
    for arg, default in pairs:
        if arg.arg in stored:
            continue
        try:
            out[arg.arg] = ast.literal_eval(default)
        except ValueError:
            continue
    return out


def _value(node: ast.AST, module: nn.Module, defaults: dict[str, Any]) -> Any:
    """A branch test's value from the module's attributes and the parameter defaults alone,
    else ``_UNKNOWN``."""
    try:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return module if node.id == "self" else defaults.get(node.id, _UNKNOWN)
        if isinstance(node, ast.Attribute):
            base = _value(node.value, module, defaults)
            if base is _UNKNOWN or node.attr == "training":  # set at call time
                return _UNKNOWN
            return getattr(base, node.attr, _UNKNOWN)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = _value(node.operand, module, defaults)
            return _UNKNOWN if v is _UNKNOWN else not v
        if isinstance(node, ast.BoolOp):
            values = [_value(v, module, defaults) for v in node.values]
            known = [bool(v) for v in values if v is not _UNKNOWN]
            if isinstance(node.op, ast.And):
                return False if False in known else True if len(known) == len(values) else _UNKNOWN
            return True if True in known else False if len(known) == len(values) else _UNKNOWN
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            a = _value(node.left, module, defaults)
            b = _value(node.comparators[0], module, defaults)
            if a is _UNKNOWN or b is _UNKNOWN:
                return _UNKNOWN
            op = node.ops[0]
            return {ast.Is: lambda: a is b, ast.IsNot: lambda: a is not b,
                    ast.Eq: lambda: a == b, ast.NotEq: lambda: a != b,
                    ast.Gt: lambda: a > b, ast.Lt: lambda: a < b,
                    ast.GtE: lambda: a >= b, ast.LtE: lambda: a <= b}.get(
                        type(op), lambda: _UNKNOWN)()
    except Exception:  # noqa: BLE001 - a tensor's truth value, a comparison that fails
        return _UNKNOWN
    return _UNKNOWN


def _live(node: ast.AST, module: nn.Module, defaults: dict[str, Any]) -> Iterator[ast.AST]:
    """Every node of ``node`` on a branch the module may take."""
    yield node
    if isinstance(node, (ast.If, ast.IfExp)):
        test = _value(node.test, module, defaults)
        try:  # a tensor's truth value (``if self.scale:`` on a vector) is not known here
            taken = None if test is _UNKNOWN else bool(test)
        except Exception:  # noqa: BLE001
            taken = None
        branches = ([node.body, node.orelse] if taken is None else
                    [node.body] if taken else [node.orelse])
        yield from _live(node.test, module, defaults)
        for branch in branches:
            for child in (branch if isinstance(branch, list) else [branch]):
                yield from _live(child, module, defaults)
        return
    for child in ast.iter_child_nodes(node):
        yield from _live(child, module, defaults)


def _self_path(node: ast.AST) -> str | None:
    """``"a.b"`` for ``self.a.b``; None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and names:
        return ".".join(reversed(names))
    return None


def _is_value_read(node: ast.Attribute, parents: dict[int, ast.AST]) -> bool:
    """Whether ``self.<path>.weight`` here is used as a tensor: not assigned, not asked for
    its metadata, not tested (a comparison, a truth value, ``isinstance`` …)."""
    if not isinstance(node.ctx, ast.Load):
        return False
    parent = parents.get(id(node))
    if isinstance(parent, ast.Attribute):
        return not (parent.attr in _META or parent.attr.startswith("is_"))
    if isinstance(parent, (ast.Compare, ast.BoolOp)):
        return False
    if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not):
        return False
    if isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)) and parent.test is node:
        return False
    return not (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name)
                and parent.func.id in _TESTS)


def weight_reads(module: nn.Module) -> list[tuple[str, str, str]]:
    """``(child path, "weight"|"bias", "Class.method")`` for every child tensor a method
    reachable from ``module.forward`` computes with on a branch this module may take."""
    methods = _methods(type(module))
    found: list[tuple[str, str, str]] = []
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        fn, owner, parents = methods[name]
        defaults = _defaults(fn)
        for node in _live(fn, module, defaults):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
                todo.append(node.func.attr)
            elif isinstance(node, ast.Attribute) and node.attr in ("weight", "bias"):
                path = _self_path(node.value)
                if path is not None and _is_value_read(node, parents):
                    found.append((path, node.attr, f"{owner}.{name}"))
    return found


def source_weight_readers(module: nn.Module) -> dict[str, str]:
    """The children of ``module`` whose weight it reads instead of calling them (relative
    path → why), from :func:`weight_reads`."""
    out: dict[str, str] = {}
    for path, which, where in sorted(weight_reads(module), key=lambda r: r[1] != "weight"):
        try:
            child = module.get_submodule(path)
        except AttributeError:
            continue
        if child is not module and path not in out:
            out[path] = f"{where} reads self.{path}.{which} directly instead of calling it"
    return out
