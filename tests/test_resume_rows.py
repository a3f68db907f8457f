"""A resumed fit's round rows count client-steps on from the interrupted fit's, like one uninterrupted fit.

Before, ``logs/metrics.csv`` kept the committed stages' rows and their ``global_round``, but the
cumulative ``client_steps`` column of the resumed stages restarted from 0 (632 where the
uninterrupted fit had 8132 on digits; the final row said 19860 again). References: the same fit
run uninterrupted (its rows), and the total client-steps in metrics.json.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from _tiny import StopAfter, tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.models import MLP


def _fit(root: Path, name: str, ckpt_path: str | None = None, callbacks=None) -> Path:
    tr = tiny_trainer(root, vectorize="always", callbacks=callbacks, run_name=name)
    data = tiny_data((6,), per_client=12, classes=3, partition="iid")
    tr.fit(tiny_model(MLP), data, ckpt_path=ckpt_path)
    return tr.run_dir


def _rounds(run: Path) -> list[dict[str, str]]:
    with open(run / "logs" / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("round")]


def test_resumed_rows_count_client_steps_on(tmp_path: Path):
    reference = _fit(tmp_path, "uninterrupted")
    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path, "killed", callbacks=[StopAfter(2)])
    run = _fit(tmp_path, "killed", ckpt_path=str(tmp_path / "killed"))
    ref, got = _rounds(reference), _rounds(run)
    assert len(got) == len(ref) > 0 and len({r["step"] for r in got}) == len(got)  # no duplicate rows
    keys = ("step", "stage", "round", "global_round", "client_steps")
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in ref]
    total = json.loads((run / "metrics.json").read_text())["client_steps"]
    assert float(got[-1]["client_steps"]) == total
