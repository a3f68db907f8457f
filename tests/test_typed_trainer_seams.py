"""No ``trainer: Any`` and no attributes set on a trainer from outside it: the seams are typed.

Callbacks get a :class:`~fedshard_lightning.callbacks.view.RunView`, the loggers' state is the
:class:`~fedshard_lightning.loggers.reporter.RunReporter`'s, helpers take what they use, and the
commands' bodies are :class:`FederatedTrainer`'s own methods. The allow-lists below are empty and
must stay so.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import fedshard_lightning

PACKAGE = Path(fedshard_lightning.__file__).parent

#: ``trainer: Any`` parameters still allowed, per file.
TRAINER_ANY: dict[str, int] = {}

#: ``trainer.ATTR = ...`` still allowed outside ``FederatedTrainer`` itself, per file and attribute.
TRAINER_ASSIGNMENTS: set[tuple[str, str]] = set()


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _is_trainer(node: ast.expr) -> bool:
    """``trainer`` or ``<anything>.trainer``: an object named as a trainer."""
    return (isinstance(node, ast.Name) and node.id == "trainer") or (
        isinstance(node, ast.Attribute) and node.attr == "trainer"
    )


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            out.append(target)
    return out


def _assignments(source: str) -> set[str]:
    """Attributes that ``source`` sets on a trainer (``trainer.x = ...``, ``setattr(trainer, "x", ...)``)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and _is_trainer(target.value):
                out.add(target.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
            and _is_trainer(node.args[0])
        ):
            out.add(ast.unparse(node.args[1]) if len(node.args) > 1 else "?")
    return out


def test_no_trainer_typed_any_outside_the_listed_files():
    found = Counter()
    for name, source in _sources().items():
        n = len(re.findall(r"\btrainer: Any\b", source))
        if n:
            found[name] = n
    extra = {k: v for k, v in found.items() if v > TRAINER_ANY.get(k, 0)}
    assert not extra, f"new `trainer: Any` (type it, or pass a RunView / what the function uses): {extra}"
    assert dict(found) == TRAINER_ANY, f"fewer now: shrink TRAINER_ANY to {dict(found)}"


def test_nothing_sets_attributes_on_a_trainer_from_outside():
    found = {
        (name, attr)
        for name, source in _sources().items()
        if name != "trainer/trainer.py"  # FederatedTrainer's own (``self.x``) are not counted anyway
        for attr in _assignments(source)
    }
    assert found <= TRAINER_ASSIGNMENTS, (
        f"attributes set on a trainer from outside it (give the owner a method): {sorted(found - TRAINER_ASSIGNMENTS)}"
    )
    assert found == TRAINER_ASSIGNMENTS, (
        f"gone, remove from TRAINER_ASSIGNMENTS: {sorted(TRAINER_ASSIGNMENTS - found)}"
    )


def test_the_checks_see_what_they_look_for():
    assert _assignments("trainer.wandb_deferred = True") == {"wandb_deferred"}
    assert _assignments("a, self.trainer.csv_history = 1, []") == {"csv_history"}
    assert _assignments("trainer.x += 1\nsetattr(trainer, 'y', 2)") == {"x", "'y'"}
    assert _assignments("trainer.store.requests = []\nrun.x = 1") == set()


def test_no_function_takes_a_trainer_as_its_first_parameter_to_reach_into_it():
    found = []
    for name, source in _sources().items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args
                first = [a.arg for a in args if a.arg not in ("self", "cls")][:1]
                if first == ["trainer"]:
                    found.append(f"{name}:{node.lineno} {node.name}")
    # the one allowed: TrainerEvents.__init__, the events object the trainer's own module makes for it
    assert all(f.startswith("trainer/trainer.py:") and f.endswith(" __init__") for f in found), found
    assert len(found) <= 1, found
