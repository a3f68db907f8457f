"""Fixtures of the reliability tests: one finished tiny run, and killed subprocesses started early."""

from __future__ import annotations

from pathlib import Path

import pytest
from _reliability_helpers import TINY, Background, cli, copy_run, crash_plans, unlearn_plans


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """An uninterrupted in-process fit of the tiny config (seed 0); never modify it, copy it."""
    root = tmp_path_factory.mktemp("reference")
    code, _, err = cli(["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.run_name", "ref"])
    assert code == 0, err
    return root / "ref"


@pytest.fixture(scope="session")
def unlearned_run(tmp_path_factory, reference_run) -> Path:
    """A copy of the reference run after ``unlearn --clients [2]``; never modify it, copy it."""
    run = copy_run(reference_run, tmp_path_factory.mktemp("unlearned") / "ref")
    code, _, err = cli(["unlearn", "--ckpt_path", str(run), "--clients", "[2]"])
    assert code == 0, err
    return run


def _selected(request, filename: str) -> bool:
    return any(Path(str(item.fspath)).name == filename for item in request.session.items)


@pytest.fixture(scope="session", autouse=True)
def background(request, tmp_path_factory):
    """The killed subprocesses of the crash and journal tests, started as the session begins.

    Their Python start-up (most of their cost) then overlaps the in-process tests.
    """
    bg = Background()
    if _selected(request, "test_crash_resume.py"):
        root = tmp_path_factory.mktemp("killed")
        bg.start("crash", crash_plans(root), root)
    if _selected(request, "test_unlearn_journal.py"):
        root = tmp_path_factory.mktemp("unlearn_killed")
        bg.start("unlearn", unlearn_plans(root, request.getfixturevalue("reference_run")), root)
    yield bg
    bg.close()
