"""One-way layers, no import circles, a small package root.

Checked on the source, at the level of files: every ``import`` that runs counts, at module level or
inside a function (a lazy import is a dependency all the same). Imports under ``if TYPE_CHECKING:``
never run and are left out of the circle and layer checks; :func:`test_annotations_add_no_circles`
lists the circles they still close, which must shrink, never grow.

The layers, bottom to top (a package may import its own layer and those below, never above):
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fedshard_lightning

PACKAGE = Path(fedshard_lightning.__file__).parent
NAME = "fedshard_lightning"

LAYERS: list[set[str]] = [
    {"errors", "init_args", "limits"},  # leaves every layer may use
    {"launch", "flcache"},  # how a process ends; the on-disk cache
    {"data", "sharding"},  # client partitions; the shard tree, merging, rounds
    {"engine", "module"},  # vectorized FedAvg, and the user's model seam it trains
    {"models", "metrics"},  # built-in models; fairness and privacy metrics
    {"unlearning"},  # the algorithms
    {"run", "loggers"},  # a run on disk; its loggers
    {"callbacks"},  # federated hooks
    {"trainer"},  # FederatedTrainer, its loop and commands
    {"experiments"},  # compare, cascade, poisoning
    {"cli", "__main__", "__init__"},  # the command line, and the lazily imported public names
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
ROOT_LIMIT = 10
# Back-references made for annotations only (``if TYPE_CHECKING:``) that close a circle of files:
# none. A module-level function that takes the object of the module calling it types it by a
# Protocol of its own module (``kernels.base.Trainer``, ``lean_frames.LeanEngine``) instead.
ANNOTATION_CIRCLES: set[tuple[str, str]] = set()

__doc__ += "\n" + "\n".join(f"{i}. {', '.join(sorted(layer))}" for i, layer in enumerate(LAYERS)) + "\n"


def _name(path: Path) -> str:
    """``engine.local`` for ``engine/local.py``; ``engine`` for ``engine/__init__.py``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                out.update(id(n) for n in ast.walk(child))
    return out


def _resolve(dotted: str) -> str | None:
    """The package module a dotted name (``fedshard_lightning.engine.local.X``) lives in."""
    parts = dotted.split(".")[1:]
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(name: str, annotations: bool = False) -> set[str]:
    """The package modules that module ``name`` imports (lazily or not); with ``annotations``, only
    those under ``if TYPE_CHECKING:``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    checking = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if (id(node) in checking) != annotations:
            continue
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = [NAME, *package.split(".")] if package else [NAME]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == NAME or module.startswith(NAME + "."):
                targets = [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith(NAME + ".")]
        for target in targets:
            resolved = _resolve(target)
            if resolved is not None and resolved != name:
                out.add(resolved)
    return out


def _layer(name: str) -> str:
    return name.split(".")[0]


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_package_and_root_module_has_a_layer():
    missing = sorted({_layer(n) for n in MODULES} - set(RANK))
    assert not missing, f"give {missing} a place in LAYERS"


def test_no_import_circles_between_files():
    edges = {name: _imports(name) for name in MODULES}
    circles = _circles(edges)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_annotations_add_no_circles():
    """A ``TYPE_CHECKING`` import that closes a circle is a function cut out of the class it takes."""
    edges = {name: _imports(name) for name in MODULES}
    back = set()
    for name in MODULES:
        for target in _imports(name, annotations=True):
            with_it = {k: set(v) for k, v in edges.items()}
            with_it[name].add(target)
            if any(name in c and target in c for c in _circles(with_it)):
                back.add((name, target))
    assert back <= ANNOTATION_CIRCLES, f"new annotation-only circles: {sorted(back - ANNOTATION_CIRCLES)}"
    assert back == ANNOTATION_CIRCLES, (
        f"gone, remove from ANNOTATION_CIRCLES: {sorted(ANNOTATION_CIRCLES - back)}"
    )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_upward_imports(name):
    rank = RANK[_layer(name)]
    upward = sorted(t for t in _imports(name) | _imports(name, annotations=True) if RANK[_layer(t)] > rank)
    assert not upward, f"{name} (layer {rank}) imports from above it: {upward}"


def test_at_most_ten_modules_at_the_package_root():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_LIMIT, f"{len(root)} modules at the package root: {root}"


def test_no_algorithm_keeps_a_trainer():
    for path in sorted((PACKAGE / "unlearning").glob("*.py")):
        tree = ast.parse(path.read_text())
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "trainer" not in attrs, f"{path.relative_to(PACKAGE)} reaches for a trainer attribute"
        assert "attach" not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
