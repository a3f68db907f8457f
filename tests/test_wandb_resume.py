"""A resumed fit's W&B history equals ``logs/metrics.csv``: no repeated final row, rewind where rows were sent.

References: the CSV read with the csv module, W&B's offline ``.wandb`` files read record by record, and
W&B's rewind semantics as wandb-core implements them (``core/internal/runbranch/rewind.go``: the
run's history is truncated after ``_step == N``, new rows are numbered from ``N + 1``). The server
side of a rewind cannot be run here: the tests check what the client is told and writes.
"""

from __future__ import annotations

import json

from test_loggers import _objects, _rows, _synced_history


def _csv_steps(run):
    return [int(float(r["step"])) for r in _rows(run / "logs" / "metrics.csv")]


def _kept(run):
    """CSV rows up to the last stage summary (``stage/...`` columns): the rows a resumed fit keeps."""
    rows = _rows(run / "logs" / "metrics.csv")
    last = max(i for i, r in enumerate(rows) if any(v for k, v in r.items() if k.startswith("stage/")))
    return last + 1


def _segments(run):
    """(run record, history rows) of every offline segment, in the order they started."""
    from callbacks.test_replay import _wandb_records

    out = []
    for path in (run / "wandb_files" / "wandb").glob("offline-run-*/run-*.wandb"):
        record_run, rows = None, []
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run" and record_run is None:
                record_run = record.run
            elif kind == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
        out.append((record_run, rows))
    return sorted(out, key=lambda s: s[0].start_time.ToMicroseconds())


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
