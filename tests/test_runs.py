"""``python -m fedshard_lightning runs``: the listing of run directories."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedshard_lightning.cli import main
from fedshard_lightning.cli.runs import format_runs, list_runs

TINY = [
    *("--data.num_clients", "8", "--trainer.algorithm.rounds", "a2"),
    *("--trainer.algorithm.t1", "2", "--trainer.algorithm.t0", "1"),
]


def test_runs_lists_complete_interrupted_and_unlearned_runs(run_root, capsys):
    main(
        ["fit", *TINY, "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run_root)]
    )
    run = run_root / "version_0"
    main(["unlearn", "--ckpt_path", str(run), "--clients", "[1]"])
    # An interrupted copy: point CURRENT at the first stage's version.
    cut = run_root / "version_1"
    shutil.copytree(run, cut)
    current = json.loads((cut / "cache" / "CURRENT").read_text())
    first = sorted(p.name for p in (cut / "cache").iterdir() if p.name.startswith("0001-"))[0]
    manifest = (cut / "cache" / first / "manifest.json").read_bytes()
    import hashlib

    current.update(version=first, manifest_sha256=hashlib.sha256(manifest).hexdigest())
    (cut / "cache" / "CURRENT").write_text(json.dumps(current))
    (run_root / "version_2" / "cache").mkdir(parents=True)  # killed before its first commit
    capsys.readouterr()

    rows = list_runs(run_root)
    assert [r["run"].rsplit("/", 1)[-1] for r in rows] == ["version_0", "version_1", "version_2"]
    done, cut_row, empty = rows
    report = json.loads((run / "unlearn_report.json").read_text())
    assert done["method"] == "fedshard" and done["dataset"] == "digits" and done["K"] == 8
    assert done["requests"] == 1 and done["state"] == "complete"
    assert done["accuracy"] == f"{report['test_accuracy_after']:.4f}"
    assert cut_row["state"].startswith("interrupted") and "1/3" in cut_row["state"]
    assert empty["state"].startswith("interrupted") and empty["method"] == "-"
    assert "remove it and run fit again" in empty["state"], "what to do with it (fit refuses to resume it)"

    main(["runs", "--root", str(run_root)])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["run", "method", "dataset", "K", "accuracy", "requests", "state"]
    assert out == format_runs(rows) + "\n"


def test_runs_on_a_missing_root_and_an_empty_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["runs", "--root", str(tmp_path / "nothing")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: runs --root {tmp_path / 'nothing'}: no such folder;") and err.count("\n") == 1
    )
    main(["runs", "--root", str(tmp_path)])  # a folder without runs: said, exit status 0
    assert capsys.readouterr().out == f"no runs under {tmp_path}\n"


@pytest.mark.parametrize("args", [["--print_config"], ["--root"], ["--roots", "x"]])
def test_runs_bad_arguments_are_one_line(args, capsys):
    """argparse printed its usage and then the error: two lines; now one, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["runs", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: runs: ") and err.count("\n") == 1 and "--root" in err, err


def _damage(run, how):
    """A copy of ``run`` whose committed cache was damaged the way a torn write or a user leaves it."""
    cache = run / "cache"
    current = json.loads((cache / "CURRENT").read_text())
    manifest = cache / current["version"] / "manifest.json"
    if how == "torn CURRENT":
        (cache / "CURRENT").write_text('{"version": "0003-st')
    elif how == "truncated manifest":
        manifest.write_bytes(manifest.read_bytes()[:100])
    elif how == "manifest removed":
        manifest.unlink()


def test_runs_lists_a_damaged_cache_as_damaged_not_as_never_committed(run_root, capsys):
    """A complete run with a damaged cache had read 'interrupted (no stage committed)': a resume fails on it."""
    main(
        ["fit", *TINY, "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run_root)]
    )
    hows = ["torn CURRENT", "truncated manifest", "manifest removed"]
    for i, how in enumerate(hows, start=1):
        shutil.copytree(run_root / "version_0", run_root / f"version_{i}")
        _damage(run_root / f"version_{i}", how)
    (run_root / "version_4" / "cache").mkdir(parents=True)  # killed before it recorded its settings
    shutil.copytree(run_root / "version_0", run_root / "version_5")
    shutil.rmtree(run_root / "version_5" / "cache")
    (run_root / "version_5" / "cache").mkdir()  # killed after its config, before its first commit
    capsys.readouterr()
    rows = list_runs(run_root)
    assert [r["state"] for r in rows] == [
        "complete",
        *["damaged (cache verify --ckpt_path RUN names the file)"] * 3,
        "interrupted before its settings were recorded: remove it and run fit again",
        "interrupted (no stage committed: fit --ckpt_path RUN trains it from the start)",
    ]
    with pytest.raises(SystemExit) as refused:  # as the listing says
        main(
            [
                "fit",
                *TINY,
                "--trainer.enable_progress_bar",
                "false",
                "--ckpt_path",
                str(run_root / "version_4"),
            ]
        )
    assert refused.value.code == 2
    for name in ("metrics.json", "model.safetensors", "model.ckpt"):
        (run_root / "version_5" / name).unlink(missing_ok=True)
    main(["fit", *TINY, "--trainer.enable_progress_bar", "false", "--ckpt_path", str(run_root / "version_5")])
    assert list_runs(run_root)[-1]["state"] == "complete", "as the listing says"
    capsys.readouterr()
    for i, how in enumerate(hows, start=1):  # and verify does name it, in one line
        with pytest.raises(SystemExit) as exit_info:
            main(["cache", "verify", "--ckpt_path", str(run_root / f"version_{i}")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and "/cache/" in err, (how, err)


def test_runs_as_a_command_imports_neither_torch_nor_lightning(run_root, capsys):
    """`python -m fedshard_lightning runs` had imported the whole CLI (seconds): the same listing, without it."""
    main(
        ["fit", *TINY, "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run_root)]
    )
    capsys.readouterr()
    main(["runs", "--root", str(run_root)])
    expected = capsys.readouterr().out
    probe = (
        "import json, runpy, sys\n"
        f"sys.argv = ['fedshard_lightning', 'runs', '--root', {str(run_root)!r}]\n"
        "code = 0\n"
        "try:\n"
        "    runpy.run_module('fedshard_lightning', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'jsonargparse') if m in sys.modules)\n"
        "print(json.dumps({'code': code, 'heavy': heavy}))\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True)
    *listing, last = out.stdout.splitlines()
    assert json.loads(last) == {"code": 0, "heavy": []}, out.stderr
    assert "\n".join(listing) + "\n" == expected


def test_runs_finds_runs_at_any_depth_and_shows_a_locked_unfinished_fit_as_running(run_root, capsys):
    """Reference: folders made by hand, and a lock taken with ``fcntl.flock`` as a running command holds it."""
    import fcntl

    for rel in (
        "version_0",
        "exp/a/version_2",
        "exp/a/version_10",
        "compare/runs/fedshard-s0",
        "notes/empty",
    ):
        (run_root / rel).mkdir(parents=True)
    for rel in ("version_0", "exp/a/version_2", "exp/a/version_10", "compare/runs/fedshard-s0"):
        (run_root / rel / "cache").mkdir()
    (run_root / "version_0" / "cache" / "nested_run" / "cache").mkdir(parents=True)  # inside a run: not a run
    names = [str(Path(r["run"]).relative_to(run_root)) for r in list_runs(run_root)]
    assert names == ["compare/runs/fedshard-s0", "exp/a/version_2", "exp/a/version_10", "version_0"]

    fd = os.open(run_root / "exp" / "a" / "version_2", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fit before its first commit holds this
    try:
        states = {Path(r["run"]).name: r["state"] for r in list_runs(run_root)}
    finally:
        os.close(fd)
    assert states["version_2"] == "running"
    assert states["version_10"].startswith("interrupted")
    assert Path(list_runs(run_root)[1]["run"]).name == "version_2"
    assert list_runs(run_root)[1]["state"].startswith("interrupted"), "the lock is gone with its process"


def test_runs_lists_a_run_that_kept_only_its_final_model(run_root, capsys):
    main(
        [
            *("fit", *TINY, "--trainer.enable_progress_bar", "false", "--trainer.enable_fairness", "false"),
            *("--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(run_root)),
        ]
    )
    (row,) = list_runs(run_root)
    metrics = json.loads((run_root / "version_0" / "metrics.json").read_text())
    assert row["state"].startswith("complete, final model only")
    assert (row["method"], row["K"], row["accuracy"]) == ("fedshard", 8, f"{metrics['test_accuracy']:.4f}")
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(["unlearn", "--ckpt_path", str(run_root / "version_0"), "--clients", "[1]"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "enable_checkpointing false" in err[-1]
