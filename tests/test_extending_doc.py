"""docs/extending.md is run: every code block, as a user would, from a folder outside the package.

Python and YAML blocks are written to the file named in their first comment line; the bash
block's commands run in that folder (``python -m fedshard_lightning ...`` in-process, through
the CLI's ``main``). The guide's claims are then checked against the run: the user's classes
were used by class_path, unlearning retrained two shards only, the audit is bit-exact, and the
user's state and events reached the cache and the run directory.
"""

from __future__ import annotations

import json
import re
import runpy
import shlex
import sys
from pathlib import Path

from _cli import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
BLOCK = re.compile(r"```(python|yaml|bash)\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(DOC.read_text())


def _run(line: str, capsys) -> str:
    """One command of the bash block; returns its stdout (stderr must hold no error)."""
    args = shlex.split(line.split("  #")[0])
    if args[:2] == ["python", "make_csv.py"]:
        runpy.run_path("make_csv.py", run_name="__main__")
        return ""
    assert args[:2] == ["python", "-m"], line
    if args[2] == "fedshard_lightning":
        code, out, err = cli(args[3:])
    else:
        main = __import__(args[2], fromlist=["main"]).main
        with _no_exit():
            main(args[3:])
        captured = capsys.readouterr()
        code, out, err = 0, captured.out, captured.err
    assert code == 0, f"{line}: exit {code}: {err}"
    assert "error:" not in err, err
    return out


class _no_exit:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is SystemExit and value.code in (0, None)


def test_every_block_of_the_extension_guide_runs(tmp_path, monkeypatch, capsys):
    blocks = _blocks()
    assert [k for k, _ in blocks].count("bash") == 1
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        monkeypatch.delitem(sys.modules, mod)
    outputs: dict[str, str] = {}
    for kind, body in blocks:
        first = body.splitlines()[0]
        if kind in ("python", "yaml"):
            name = first.lstrip("# ").strip()
            assert re.fullmatch(r"[\w/]+\.(py|yaml)", name), f"block without a file name: {first}"
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(body)
            continue
        for line in body.splitlines():
            if line.startswith("export "):
                continue
            outputs[line] = _run(line, capsys)

    run = tmp_path / "runs" / "version_0"
    report = json.loads((run / "unlearn_report.json").read_text())
    assert report["algorithm"] == "isolated_shards" and report["clients"] == [1, 6]
    assert 0 < report["client_steps"] == report["predicted_client_steps"] < report["retrain_client_steps"]
    assert report["seconds"] > 0  # the method returned 0.0: the trainer timed it
    audit = next(v for k, v in outputs.items() if " audit " in k)
    assert "audit PASSED" in audit and "max|diff| = 0.000e+00" in audit
    listing = next(v for k, v in outputs.items() if " runs " in k)
    assert re.search(r"runs/version_0\s+isolated_shards\s+csv\s+8\s", listing), listing
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("round") == 4 and events[-1]["event"] == "unlearn"
    assert "train_acc" in (run / "logs" / "metrics.csv").read_text().splitlines()[0]
    assert (
        "class_path: mypkg.fedmodel.TabMLP" in (tmp_path / "runs" / "version_1" / "config.yaml").read_text()
    )
    assert (tmp_path / "runs" / "version_1" / "model.safetensors").is_file()
    table = (tmp_path / "compare" / "compare.md").read_text()
    assert (
        "| fedshard (rounds: fixed) |" in table and "| isolated_shards |" in table
    )  # a departure is labelled
