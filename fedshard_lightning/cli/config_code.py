"""A config is code: every ``class_path`` it names is imported, and importing a module runs it.

``test``, ``unlearn``, ``audit`` and a resuming ``fit`` read the run's own ``config.yaml``. A run
folder handed over by someone else could name ``class_path: evilmod.Net`` and ship ``evilmod.py``
beside it; run from inside that folder, Python would import (execute) it before any type check.
So a run's config may name only modules already loaded or provided by an installed distribution
(``pip install``), and never one found inside the run folder; anything else is refused in one
line before anything is imported, unless the user says ``--trust_run_config`` (they read the
config and its modules and trust them).

Nothing here imports the modules it checks: :func:`importlib.util.find_spec` of a top-level name
only searches ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

from fedshard_lightning.errors import ConfigError

__all__ = ["TRUST_FLAG", "check_run_config_code", "class_paths"]

TRUST_FLAG = "--trust_run_config"

# A dotted name that ends in a class name: ``pkg.mod.Name`` (file names such as ``mnist.npz`` do not).
_DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\.[A-Z]\w*$")


def class_paths(data: Any) -> list[str]:
    """Every dotted name a config could import: ``class_path`` values and dotted class names anywhere.

    jsonargparse also accepts a bare ``model: pkg.Net`` for a subclass field, so every string that
    ends in a class name counts, not only the ``class_path`` keys.
    """
    found: list[str] = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            path = item.get("class_path")
            if isinstance(path, str) and "." in path:
                found.append(path.strip())
            stack.extend(v for k, v in item.items() if k != "class_path")
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and _DOTTED.match(item.strip()):
            found.append(item.strip())
    return found


@cache
def _distributed() -> frozenset[str]:
    """Top-level module names that installed distributions provide."""
    from importlib.metadata import packages_distributions

    return frozenset(packages_distributions())


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except (ValueError, OSError):
        return False
    return True


def _origin(name: str) -> Path | None:
    """Where ``import name`` would load the top-level module from, without importing it (None: nowhere)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin)
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else None


def _why_untrusted(module: str, run_dir: Path) -> str | None:
    """Why importing ``module`` could run code the user did not install (None: it could not)."""
    if module in sys.modules:
        return None  # loaded already: importing it runs nothing new
    origin = _origin(module)
    if origin is None:
        return None  # nothing to import: jsonargparse refuses the name itself
    if _inside(origin, run_dir):
        return f"module {module} would be imported from the run folder ({origin})"
    if module not in _distributed():
        return f"module {module} is not from an installed package (it would be imported from {origin})"
    return None


def check_run_config_code(config: Path, data: Any, trusted: bool) -> None:
    """Refuse a run's config that names a module from outside the installed packages, before any import.

    Args:
        config: The run's ``config.yaml``.
        data: Its parsed content.
        trusted: Whether the user gave ``--trust_run_config``.

    Raises:
        ConfigError: Naming the class path, where its module would come from, and the flag.
    """
    if trusted:
        return
    for name in class_paths(data):
        why = _why_untrusted(name.split(".", 1)[0], config.parent)
        if why is not None:
            raise ConfigError(
                f"{config}: class_path {name}: {why}; a config is code (its class paths are imported), so "
                f"read it and the module, then add {TRUST_FLAG} to run it, or install the module (pip install)"
            )
