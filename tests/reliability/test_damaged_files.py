"""Files a user or a crash damaged, read back: one line naming the file, exit 2, nothing rewritten.

Found by an audit: configs that are not UTF-8 or empty, a numerics.json that is JSON but not an
object, a journal with torn or damaged lines, ``test`` on a fit killed before its first commit,
``fit --ckpt_path`` on a complete run, ``runs --root`` pointed at a run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _reliability_helpers import TINY, changed_files, cli, copy_run, error_lines, snapshot

from fedshard_lightning.run.directory import Journal


def _one_error(code: int, err: str, *needles: str) -> None:
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("# caf\xe9\nseed_everything: 1\n".encode("latin-1"), "not UTF-8 text (byte 5)"),
        (b"", "the file is empty"),
        (b"- a\n- b\n", "expected a mapping of settings, got list"),
    ],
)
def test_a_damaged_config_is_named(tmp_path, reference_run, content, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    code, _, err = cli(
        ["fit", "--config", str(bad), *TINY, "--trainer.default_root_dir", str(tmp_path / "r")]
    )
    _one_error(code, err, f"--config {bad}: {needle}")
    run = copy_run(reference_run, tmp_path / "run")
    (run / "config.yaml").write_bytes(content)
    before = snapshot(run)
    code, _, err = cli(["test", "--ckpt_path", str(run)])
    _one_error(code, err, f"{run / 'config.yaml'}: {needle}", "restore it")
    assert changed_files(before) == []


def test_numerics_json_that_is_not_an_object(tmp_path, reference_run, capsys):
    run = copy_run(reference_run, tmp_path / "run")
    (run / "numerics.json").write_text("null")
    code, out, err = cli(["audit", "--ckpt_path", str(run)])
    assert code == 0, err
    assert "numerics.json is unreadable: the numerical environment of fit is unknown" in out


def test_journal_skips_damaged_lines_and_appends_after_a_torn_one(tmp_path):
    journal = Journal(tmp_path)
    journal.path.parent.mkdir()
    lines = [
        b'{"event": "committed", "request": 1}',
        b'{"event": "committed", "request": "x"}',  # damaged: skipped, not a crash
        b'["committed", 2]',
        b"\xff\xfe not utf-8",
        b'{"event": "committed", "request": 3}',
        b'{"event": "comm',  # torn by a crash mid-append
    ]
    journal.path.write_bytes(b"\n".join(lines))
    assert journal.committed() == {1, 3}
    journal.append({"event": "committed", "request": 4})
    assert journal.committed() == {1, 3, 4}
    assert journal.path.read_bytes().endswith(b'{"event": "comm\n') is False
    assert json.loads(journal.path.read_bytes().splitlines()[-1])["request"] == 4


def test_test_on_a_fit_killed_before_its_first_commit(tmp_path, reference_run):
    run = copy_run(reference_run, tmp_path / "run")
    for name in ("cache/CURRENT", "model.safetensors"):
        (run / name).unlink()
    code, _, err = cli(["test", "--ckpt_path", str(run)])
    _one_error(code, err, "has no committed FLCache", "resume it with fit --ckpt_path")


def test_fit_resumed_on_a_complete_run_rewrites_nothing(tmp_path, reference_run):
    run = copy_run(reference_run, tmp_path / "run")
    keep = {n: (run / n).read_bytes() for n in ("metrics.json", "numerics.json", "model.safetensors")}
    code, out, err = cli(["fit", "--ckpt_path", str(run)])
    assert code == 0, err
    assert "was already complete; nothing was trained" in out
    assert {n: (run / n).read_bytes() for n in keep} == keep


def test_runs_root_pointed_at_a_run(reference_run):
    code, _, err = cli(["runs", "--root", str(reference_run)])
    _one_error(code, err, "this is a run directory; give the folder that holds it")


def test_the_unreadable_config_of_one_run_does_not_stop_the_listing(tmp_path, reference_run):
    run = copy_run(reference_run, tmp_path / "a_run")
    (run / "config.yaml").write_bytes(b"data: \xff\n")
    code, out, err = cli(["runs", "--root", str(tmp_path)])
    assert code == 0 and "a_run" in out, err
    assert Path(run).is_dir()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--seed_everything", "-1"], "error: seed_everything=-1: give an integer in [0, 2**32)"),
        (
            ["--seed_everything", "4294967296"],
            "error: seed_everything=4294967296: give an integer in [0, 2**32)",
        ),
        (["--data.seed", "-1"], "error: data.seed=-1: the partition seed must be an integer in [0, 2**32)"),
        (["--data.rho", "inf"], "error: data.rho: expected a float, got inf; give a finite number"),
        (["--data.num_clients", "eight"], "error: data.num_clients: expected an int, got eight"),
        (["--model.init_args.nosuch", "3"], "error: model: unknown option 'nosuch'; --print_config lists"),
        (
            ["--model", "fedshard_lightning.models.NoSuch"],
            "error: model: class_path fedshard_lightning.models.NoSuch: module 'fedshard_lightning.models' has no",
        ),
        (
            ["--model.input_shape", "[-1]"],
            "error: model.input_shape=[-1]: the data's samples have shape [1, 8, 8]",
        ),
    ],
)
def test_settings_out_of_range_or_of_the_wrong_type_name_the_field(tmp_path, args, line):
    """Before: tracebacks (seeds, input shape) or jsonargparse's nested dump of every Union member."""
    root = tmp_path / "runs"
    code, _, err = cli(["fit", *TINY, "--trainer.default_root_dir", str(root), *args])
    _one_error(code, err, line)
    assert not root.exists() or not any(root.iterdir())


def test_a_folder_where_a_file_belongs_is_bad_input_not_a_failing_disk(tmp_path, reference_run):
    """README: a damaged run directory exits 2 (it exited 7, 'check the disk')."""
    run = copy_run(reference_run, tmp_path / "run")
    (run / "model.safetensors").unlink()
    (run / "model.safetensors").mkdir()
    code, _, err = cli(["test", "--ckpt_path", str(run)])
    _one_error(code, err, "(EISDIR)", "a folder stands where a file belongs")
    run2 = copy_run(reference_run, tmp_path / "run2")
    (run2 / "cache" / "CURRENT").unlink()
    (run2 / "cache" / "CURRENT").mkdir()
    code, _, err = cli(["audit", "--ckpt_path", str(run2)])
    _one_error(code, err, "CURRENT is not a regular file: the run directory is damaged")
