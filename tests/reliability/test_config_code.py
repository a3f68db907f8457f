"""A run's config.yaml is code: a module it names from the run folder or the working directory never runs.

A run folder handed over by someone else ships ``evilmod.py`` beside a config that names
``class_path: evilmod.Net``; ``test --ckpt_path .`` run from inside that folder (the folder is then
first on ``sys.path``) must refuse it in one line before the module executes, and run it only
when the user says ``--trust_run_config``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from _reliability_helpers import cli, copy_run, error_lines, tree_hash

from fedshard_lightning.cli.config_code import class_paths

_EVIL = """
from pathlib import Path
Path(__file__).with_name("EXECUTED").write_text("evilmod ran")
class Net:
    pass
"""


def _handed_over(reference_run: Path, folder: Path, class_path: str, module: str | None) -> Path:
    """A copy of a run whose config names ``class_path`` as its model, with ``module``.py beside it."""
    run = copy_run(reference_run, folder)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"] = {"class_path": class_path}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    if module:
        (run / f"{module}.py").write_text(_EVIL)
    return run


@pytest.fixture
def clean_modules(monkeypatch):
    """Forget the planted modules afterwards (a trusted run imports them into this process)."""
    yield
    for name in ("evilmod", "localmod"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("command", [["test"], ["audit"], ["unlearn", "--clients", "[1]"], ["fit"]])
def test_a_module_in_the_run_folder_is_not_imported(
    command, reference_run, tmp_path, monkeypatch, clean_modules
):
    run = _handed_over(reference_run, tmp_path / "run", "evilmod.Net", "evilmod")
    monkeypatch.chdir(run)
    monkeypatch.syspath_prepend(str(run))  # python -m run from inside the folder puts it first
    before = tree_hash(run)
    code, _, err = cli([command[0], "--ckpt_path", ".", *command[1:]])
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "evilmod.Net" in lines[0] and "run folder" in lines[0] and "--trust_run_config" in lines[0]
    assert "evilmod" not in sys.modules
    assert not (run / "EXECUTED").exists()
    assert tree_hash(run) == before


def test_a_module_in_the_working_directory_is_refused(reference_run, tmp_path, monkeypatch, clean_modules):
    run = _handed_over(reference_run, tmp_path / "run", "localmod.Net", None)
    work = tmp_path / "work"
    work.mkdir()
    (work / "localmod.py").write_text(_EVIL)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    code, _, err = cli(["test", "--ckpt_path", str(run)])
    assert code == 2 and "not from an installed package" in err and "localmod.Net" in err, err
    assert "localmod" not in sys.modules and not (work / "EXECUTED").exists()


def test_a_standard_library_module_with_side_effects_is_refused(reference_run, tmp_path):
    """``this`` prints on import; it is no installed distribution, so a run's config may not name it."""
    assert "this" not in sys.modules
    run = _handed_over(reference_run, tmp_path / "run", "this.Net", None)
    code, out, err = cli(["test", "--ckpt_path", str(run)])
    assert code == 2 and "this.Net" in err and "The Zen of Python" not in out + err
    assert "this" not in sys.modules


def test_the_flag_lets_a_trusted_run_import_it(reference_run, tmp_path, monkeypatch, clean_modules):
    run = _handed_over(reference_run, tmp_path / "run", "evilmod.Net", "evilmod")
    monkeypatch.chdir(run)
    monkeypatch.syspath_prepend(str(run))
    code, _, err = cli(["test", "--ckpt_path", ".", "--trust_run_config"])
    assert (run / "EXECUTED").exists()  # imported: the user said so
    assert code == 2 and "Net" in err  # then refused as a model: it is no LightningModule


def test_the_run_configs_of_installed_classes_pass(reference_run, tmp_path):
    run = copy_run(reference_run, tmp_path / "run")
    code, _, err = cli(["test", "--ckpt_path", str(run)])
    assert code == 0, err


def test_class_paths_finds_nested_and_bare_names():
    config = {
        "model": {"class_path": "a.b.Net", "init_args": {"file": "mnist.npz", "inner": "c.Other"}},
        "trainer": {"callbacks": [{"class_path": "d.e.Callback"}], "name": "plain"},
        "data": "f.Data",
    }
    assert sorted(class_paths(config)) == ["a.b.Net", "c.Other", "d.e.Callback", "f.Data"]
