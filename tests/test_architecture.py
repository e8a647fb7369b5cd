"""The package's architecture, checked from its source (issue 22).

* **Floors**: every module of ``bayesify/`` sits on a floor and imports only its own
  floor or floors below (function-local imports included, and ``if TYPE_CHECKING:``
  imports too: a type is a dependency). Floors, bottom up::

      1 errors, metrics, version, atomic_files, progress
      2 core            (batch convention, walker, layers, model, state, Method, fitting types)
      3 kit             (family kit: tiled / rank-1 / weight-space layers, knobs, steps)
      4 methods/<name>  (each family: its own folder + core, kit, errors, metrics)
      5 predict, persistence, posterior_format, posterior_commit, data, plots
      6 train           (the one epoch driver, fit context, knob search, shift signal)
      7 evaluation, acquisition, demo, integrations
      8 cli, cli_inputs, entry, the package itself (``bayesify/__init__``: the public API)

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
import gc
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "bayesify"

FLOORS: list[tuple[int, tuple[str, ...]]] = [
    (1, ("bayesify.errors", "bayesify.metrics", "bayesify.version", "bayesify.atomic_files",
         "bayesify.progress")),
    (2, ("bayesify.core",)),
    (3, ("bayesify.kit",)),
    (4, ("bayesify.methods",)),
    (5, ("bayesify.predict", "bayesify.persistence", "bayesify.posterior_format",
         "bayesify.posterior_commit", "bayesify.data", "bayesify.plots")),
    (6, ("bayesify.train",)),
    (7, ("bayesify.evaluation", "bayesify.acquisition", "bayesify.demo", "bayesify.integrations")),
    (8, ("bayesify.cli", "bayesify.cli_inputs", "bayesify.entry", "bayesify")),
]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_only: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
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


# -- Method is small, and the driver calls only what is declared --------------------------
def method_members(cls: type) -> list[str]:
    """Non-dunder attributes, methods and properties defined on ``cls`` itself (annotated
    instance attributes included)."""
    names = {n for n in vars(cls) if not (n.startswith("__") and n.endswith("__"))}
    names |= set(getattr(cls, "__annotations__", {}))
    return sorted(names)


def test_method_has_at_most_twelve_members():
    from bayesify.core.method import Method

    members = method_members(Method)
    assert len(members) <= 12, members
    assert set(members) == {"name", "config_cls", "wrappers", "config", "components", "build",
                            "prepare", "step", "knobs", "predictive", "member_logits",
                            "export_module"}

    class Wider(Method):  # the check sees a thirteenth member
        pass

    Wider.__annotations__ = {}
    for name in members + ["training"]:
        setattr(Wider, name, None)
    assert len(method_members(Wider)) == 13


def attribute_uses(tree: ast.AST, owners: set[str]) -> set[str]:
    """``X.<attr>`` for every ``X`` that is a name or attribute called one of ``owners``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            owner = (value.id if isinstance(value, ast.Name)
                     else value.attr if isinstance(value, ast.Attribute) else None)
            if owner in owners:
                found.add(node.attr)
    return found


def test_code_above_the_families_calls_only_declared_method_and_step_members():
    from bayesify.core.fitting import FitContext, Step
    from bayesify.core.method import Method

    declared = set(method_members(Method))
    step_declared = set(method_members(Step))
    context_declared = set(method_members(FitContext))
    for name, path in modules().items():
        if floor_of(name) < 5:
            continue  # families and the kit may call their own helpers
        tree = ast.parse(path.read_text())
        used = attribute_uses(tree, {"method"})
        assert used <= declared, f"{name} calls undeclared Method members {used - declared}"
        steps = attribute_uses(tree, {"family", "step"})
        assert steps <= step_declared, f"{name} calls undeclared Step members {steps - step_declared}"
    # what families call on the context is declared by FitContext
    for name, path in modules().items():
        if name.startswith(("bayesify.kit.", "bayesify.methods.")):
            used = attribute_uses(ast.parse(path.read_text()), {"ctx"})
            assert used <= context_declared, f"{name} uses undeclared context members {used - context_declared}"
    doctored = ast.parse("def f(bnn):\n    bnn.method.begin_fit(bnn)\n")
    assert not attribute_uses(doctored, {"method"}) <= declared


# -- one data loop ------------------------------------------------------------------------
ITERATION_ENTRY_POINTS = {"iter_batches", "limited_batches"}  # core.batch: a loader → Batches


def data_iterations(tree: ast.AST) -> set[str]:
    """Calls of the data-iteration entry points, and ``for … in <something named *loader*>``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in ITERATION_ENTRY_POINTS:
                found.add(name)
        if isinstance(node, (ast.For, ast.comprehension)):
            target = node.iter
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if "loader" in str(name):
                found.add(f"for … in {name}")
    return found


def test_one_module_iterates_training_data():
    iterating = {name for name, path in modules().items()
                 if name.startswith(("bayesify.core.", "bayesify.kit.", "bayesify.methods.",
                                     "bayesify.train."))
                 and name != "bayesify.core.batch"  # defines the entry points
                 and data_iterations(ast.parse(path.read_text()))}
    assert iterating == {"bayesify.train.data"}
    doctored = ast.parse("def bn_pass(loader):\n    for batch in loader:\n        pass\n")
    assert data_iterations(doctored), "a family iterating a loader itself is seen"


# -- the knob search streams the validation split -------------------------------------------
class TrackedLoader:
    """Yields ``(x, y)`` batches and records how many yielded inputs are still alive (held
    by anyone) whenever a new batch is produced: the search's batch footprint."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size
        self.live: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self.peak = 0

    def __len__(self) -> int:
        return (len(self.x) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        for start in range(0, len(self.x), self.batch_size):
            gc.collect(0)  # the young generation: a cycle holding a batch is young
            xb = self.x[start:start + self.batch_size].clone()
            self.live.add(xb)
            self.peak = max(self.peak, len(self.live))
            yield xb, self.y[start:start + self.batch_size]


def _small_fitted(method: str = "ibnn"):
    from bayesify import bayesify, fit

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    x, y = torch.randn(48, 4), torch.randint(0, 3, (48,))
    bnn = bayesify(net, method)
    fit(bnn, DataLoader(TensorDataset(x, y), batch_size=16), progress=False, seed=0)
    return bnn


def test_knob_search_holds_one_validation_batch_at_a_time():
    from bayesify.train.data import shard_batches
    from bayesify.train.distributed import DistContext
    from bayesify.train.tuning import search_knobs

    bnn = _small_fitted()
    val = TrackedLoader(torch.randn(64, 4), torch.randint(0, 3, (64,)), batch_size=8)
    ctx = DistContext()

    def stream():
        return shard_batches(val, ctx, device=bnn.device, batch_fn=None)

    record = search_knobs(bnn, bnn.method.knobs(bnn), stream, ctx)
    assert record["ibnn_noise_scale_val_nll"] and len(val) == 8
    # the batch being produced plus at most the previous one, still referenced by the loop
    # variable until the next is ready: independent of the 8 batches of the split
    assert val.peak <= 2, val.peak
    # the check can fail: a search that materialises the split holds every batch
    val.peak = 0
    search_knobs(bnn, bnn.method.knobs(bnn), lambda: iter(list(stream())), ctx)
    assert val.peak == len(val)


def test_tune_outside_fit_equals_fit_with_a_validation_loader():
    import bayesify

    torch.manual_seed(1)
    xv, yv = torch.randn(40, 4), torch.randint(0, 3, (40,))
    val = DataLoader(TensorDataset(xv, yv), batch_size=10)
    tuned = _small_fitted()
    record = bayesify.tune(tuned, val)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    x, y = torch.randn(48, 4), torch.randint(0, 3, (48,))
    fitted = bayesify.bayesify(net, "ibnn")
    result = bayesify.fit(fitted, DataLoader(TensorDataset(x, y), batch_size=16), progress=False,
                          seed=0, val_loader=val)
    knob = "ibnn_noise_scale"
    assert record[knob] == result.last[knob]
    assert record[f"{knob}_val_nll"] == pytest.approx(result.last[f"{knob}_val_nll"], abs=1e-12)
    assert tuned.state.value(knob) == fitted.state.value(knob)
    with pytest.raises(bayesify.BayesifyError, match="builds its posterior inside bayesify.fit"):
        bayesify.tune(bayesify.bayesify(net, "laplace"), val)  # no curvature before fit


# -- one place for names --------------------------------------------------------------------
NAME_FRAGMENTS = {"base_layer", "base_layer.", ".base_layer", ".base_layer."}


def name_fragments(tree: ast.AST) -> list[int]:
    """Lines of string constants that are pieces of wrapped-model names."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in NAME_FRAGMENTS]


def test_base_layer_names_are_built_in_one_module():
    found = {name: lines for name, path in modules().items()
             if (lines := name_fragments(ast.parse(path.read_text())))}
    assert set(found) == {"bayesify.core.names"}, found
    assert name_fragments(ast.parse('key = name.replace(".base_layer.", ".")'))
