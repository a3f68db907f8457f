"""A resumed fit's W&B history equals ``logs/metrics.csv``: no repeated final row, rewind where rows were sent.

References: the CSV read with the csv module, W&B's offline ``.wandb`` files read record by record, and
W&B's rewind semantics as wandb-core implements them (``core/internal/runbranch/rewind.go``: the
run's history is truncated after ``_step == N``, new rows are numbered from ``N + 1``). The server
side of a rewind cannot be run here: the tests check what the client is told and writes.
"""

from __future__ import annotations

import json

import pytest
from test_loggers import _KillAt, _objects, _rows, _segments, _synced_history

from fedshard_lightning.callbacks import FederatedCallback


def _csv_steps(run):
    return [int(float(r["step"])) for r in _rows(run / "logs" / "metrics.csv")]


def _kept(run):
    """CSV rows up to the last stage summary (``stage/...`` columns): the rows a resumed fit keeps."""
    rows = _rows(run / "logs" / "metrics.csv")
    last = max(i for i, r in enumerate(rows) if any(v for k, v in r.items() if k.startswith("stage/")))
    return last + 1


def _server_history(run):
    """The W&B run's history once every segment is uploaded in order, each rewind applied."""
    history = []
    for record_run, rows in _segments(run):
        point = record_run.branch_point
        if point.run:
            assert (point.run, point.metric) == (record_run.run_id, "_step")
            history = [h for h in history if h["_step"] <= point.value]
        history += rows
    return history


def _record_wandb_init(monkeypatch):
    """``wandb.init`` in online mode, recorded, then run offline with the same arguments (no server here)."""
    import wandb

    calls = []
    real_init = wandb.init

    def recording_init(**kwargs):
        calls.append(dict(kwargs))
        return real_init(**kwargs, mode="offline")

    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setattr(wandb, "init", recording_init)
    return calls


def test_a_complete_fit_resumed_again_logs_no_second_final_row(run_root):
    """``fit --ckpt_path`` on a complete run trains nothing: its W&B run already holds every row once.

    It used to log the final row again (W&B one row more than the CSV: 47 against 46 on the digits run).
    """
    trainer, model, data = _objects(run_root, wandb=True)
    trainer.fit(model, data)
    run = trainer.run_dir
    trainer, model, data = _objects(run_root, wandb=True)
    trainer.fit(model, data, ckpt_path=str(run))
    synced = [h["trainer/global_step"] for h in _synced_history(run)]
    assert synced == _csv_steps(run)
    finals = [h for h in _synced_history(run) if any(k.startswith("final/") for k in h)]
    assert len(finals) == 1


def test_a_fit_resumed_after_its_segment_was_synced_rewinds_to_the_last_kept_row(run_root):
    """The killed fit's segment was uploaded (``.synced``): the resumed segment rewinds the run to the kept rows.

    Its run record carries the branch point ``(id, _step, kept - 1)`` (``wandb sync`` rewinds the run
    when it uploads it) and its rows start at ``_step == kept``; applied in order, the run's history
    equals the CSV. It used to append the retrained stage's rounds after the uploaded ones (twice).
    """
    kill = type("Kill", (_KillAt, FederatedCallback), {})(3)
    trainer, model, data = _objects(run_root, callbacks=[kill], wandb=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(model, data)
    run = trainer.run_dir
    for path in (run / "wandb_files" / "wandb").glob("offline-run-*/run-*.wandb"):
        path.with_name(path.name + ".synced").write_text("")  # as wandb sync leaves it
    kept = _kept(run)
    trainer, model, data = _objects(run_root, wandb=True)
    trainer.fit(model, data, ckpt_path=str(run))

    (first, _), (resumed, rows) = _segments(run)
    run_id = json.loads((run / "wandb.json").read_text())["id"]
    assert not first.branch_point.run
    assert (resumed.branch_point.run, resumed.branch_point.metric) == (run_id, "_step")
    assert resumed.branch_point.value == kept - 1
    assert [h["_step"] for h in rows] == list(range(kept, kept + len(rows)))
    history = _server_history(run)
    assert [h["trainer/global_step"] for h in history] == _csv_steps(run)
    assert [h["_step"] for h in history] == list(range(len(history)))
    assert not (run / "wandb_files" / "superseded").exists(), "an uploaded segment cannot be taken back"


def test_an_online_fit_resumed_passes_resume_from_to_wandb_init(run_root, monkeypatch):
    """Online, the resumed fit asks ``wandb.init`` to rewind: ``resume_from="ID?_step=<kept - 1>"``, no ``resume``.

    No server can be reached here: ``wandb.init`` is wrapped to record its arguments and then runs
    offline with them (the branch point lands in the segment's run record, as online it goes to
    the RewindRun request); the killed fit's segment is marked uploaded, as an online run's rows
    are. The first fit keeps ``resume="allow"``.
    """
    calls = _record_wandb_init(monkeypatch)
    kill = type("Kill", (_KillAt, FederatedCallback), {})(3)
    trainer, model, data = _objects(run_root, callbacks=[kill], wandb=True, wandb_mode="online")
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(model, data)
    run = trainer.run_dir
    for path in (run / "wandb_files" / "wandb").glob("offline-run-*/run-*.wandb"):
        path.with_name(path.name + ".synced").write_text("")
    kept = _kept(run)
    trainer, model, data = _objects(run_root, wandb=True, wandb_mode="online")
    trainer.fit(model, data, ckpt_path=str(run))

    run_id = json.loads((run / "wandb.json").read_text())["id"]
    assert [c.get("id") for c in calls] == [run_id, run_id]
    assert calls[0]["resume"] == "allow" and "resume_from" not in calls[0]
    assert "resume" not in calls[1] and calls[1]["resume_from"] == f"{run_id}?_step={kept - 1}"
    history = _server_history(run)
    assert [h["trainer/global_step"] for h in history] == _csv_steps(run)
    assert not (run / "wandb_files" / "superseded").exists()


def test_an_offline_fit_resumed_online_replays_the_kept_rows_instead_of_rewinding(run_root, monkeypatch):
    """The killed fit's offline segment was never synced: the server lacks the run, so it cannot be rewound.

    The resumed online fit supersedes that segment and logs the CSV's kept rows before its new
    ones (``resume="allow"``, no ``resume_from``: a RewindRun on a run the server lacks would fail).
    """
    kill = type("Kill", (_KillAt, FederatedCallback), {})(3)
    trainer, model, data = _objects(run_root, callbacks=[kill], wandb=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(model, data)
    run = trainer.run_dir
    calls = _record_wandb_init(monkeypatch)
    trainer, model, data = _objects(run_root, wandb=True, wandb_mode="online")
    trainer.fit(model, data, ckpt_path=str(run))

    assert len(calls) == 1 and calls[0]["resume"] == "allow" and "resume_from" not in calls[0]
    assert len(list((run / "wandb_files" / "superseded").iterdir())) == 1
    history = _server_history(run)
    assert [h["trainer/global_step"] for h in history] == _csv_steps(run)
