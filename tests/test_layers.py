"""One-way layers: nothing below the algorithms imports upward, and algorithms never import the trainer side.

Checked on the source (``import`` statements, including the lazy ones inside functions), so a new
back-reference fails here instead of silently coupling the layers again. ``module.py`` (the user's
model seam), ``cache.py``, ``errors.py`` and ``init_args.py`` are shared leaves every layer may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fedshard_lightning

PACKAGE = Path(fedshard_lightning.__file__).parent
TRAINER_SIDE = {
    "trainer",
    "store",
    "loop",
    "requests",
    "run_dir",
    "loggers",
    "fingerprint",
    "checkpoint",
    "cli",
    "callbacks",
    "experiments",
}
LOWER = {"engine", "sharding", "data"}


def _imports(path: Path) -> set[str]:
    """Top-level package members (``fedshard_lightning.X``) a module imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedshard_lightning."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("fedshard_lightning."))
    return out


def _modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).glob("*.py"))


@pytest.mark.parametrize("folder", sorted(LOWER))
def test_engine_sharding_and_data_import_nothing_above_them(folder):
    for path in _modules(folder):
        upward = _imports(path) & (TRAINER_SIDE | {"unlearning", "metrics"})
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)} from above it"


def test_algorithms_never_import_the_trainer_side():
    for path in _modules("unlearning"):
        upward = _imports(path) & TRAINER_SIDE
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)}"


def test_no_algorithm_keeps_a_trainer():
    for path in _modules("unlearning"):
        tree = ast.parse(path.read_text())
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "trainer" not in attrs, f"{path.relative_to(PACKAGE)} reaches for a trainer attribute"
        assert "attach" not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
