"""Loggers: hyper-parameters, run names, one W&B run per run directory, CSV history across resume."""

from __future__ import annotations

import csv
import json

import pytest
from _tiny import small_synthetic

from fedshard_lightning import FederatedTrainer
from fedshard_lightning.loggers import run_name
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedShard


def _objects(root, wandb: bool = False, seed: int = 3, **kwargs):
    data = small_synthetic()
    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=4),
        default_root_dir=str(root),
        enable_progress_bar=False,
        vectorize="always",
        wandb=wandb,
        seed=seed,
        **kwargs,
    )
    return trainer, MLP(hidden=(8,), lr=0.1), data


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _wandb_items(run_dir):
    """(config, history rows) of every offline W&B run file in the run directory."""
    from callbacks.test_replay import _wandb_records

    config, history, runs = {}, [], set()
    for path in sorted((run_dir / "wandb_files").rglob("run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.add((record.run.run_id, record.run.display_name, record.run.run_group))
                for item in record.run.config.update:
                    config[item.key] = json.loads(item.value_json)
            elif kind == "config":
                for item in record.config.update:
                    config[item.key] = json.loads(item.value_json)
            elif kind == "history":
                history.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
    return config, history, runs


def test_wandb_run_has_config_and_the_unlearning_request(run_root, capfd):
    trainer, model, data = _objects(run_root, wandb=True, wandb_group="exp-1")
    trainer.fit(model, data)
    out, err = capfd.readouterr()
    assert "anonymous" not in out + err  # W&B's warning about Lightning's anonymous=None, on every run
    run = trainer.run_dir
    state = json.loads((run / "wandb.json").read_text())
    assert state["name"] == "fedshard-synthetic-K8-rho0.5-s3" and state["group"] == "exp-1"
    trainer2, model2, data2 = _objects(run_root, wandb=True)
    report = trainer2.unlearn(model2, data2, ckpt_path=str(run), clients=[2])

    config, history, runs = _wandb_items(run)
    for key, value in {
        "method": "fedshard",
        "num_clients": 8,
        "rho": 0.5,
        "merge_rate": 2,
        "lr": 0.1,
        "seed": 3,
    }.items():
        got = config[key]["value"] if isinstance(config[key], dict) else config[key]
        assert got == value, key
    assert {r[0] for r in runs} == {state["id"]}, "unlearn resumed the fit's W&B run"
    assert {r[1] for r in runs} == {state["name"]} and {r[2] for r in runs} == {"exp-1"}
    requests = [h for h in history if "unlearn/client_steps" in h]
    assert len(requests) == 1
    assert requests[0]["unlearn/client_steps"] == report["client_steps"]
    assert requests[0]["unlearn/test_accuracy_after"] == pytest.approx(report["test_accuracy_after"])
    rounds = [h["trainer/global_step"] for h in history if "train_loss" in h]
    assert requests[0]["trainer/global_step"] > max(rounds), "the request comes after the fit's rounds"

    # The same request in CSV.
    rows = [r for r in _rows(run / "logs" / "unlearn-1" / "metrics.csv") if r["unlearn/client_steps"]]
    assert len(rows) == 1 and float(rows[0]["unlearn/client_steps"]) == report["client_steps"]


def test_run_name_reads_the_setting():
    hp = {
        "method": "fedshard",
        "dataset": "digits",
        "num_clients": 32,
        "rho": 0.5,
        "seed": 0,
        "partition": "dirichlet",
    }
    assert run_name(hp) == "fedshard-digits-K32-rho0.5-s0"
    assert run_name({**hp, "partition": "iid"}) == "fedshard-digits-K32-s0"


def test_default_wandb_group_is_the_setting_whatever_the_method_is_named(run_root):
    """The group is the setting without method and seed, also for a method named with dashes.

    Reference: the setting written out by hand. Before, the group was cut out of the run name at
    its first dash, which gave ``method-synthetic-K8-rho0.5`` for a method named ``my-method``.
    """
    trainer, model, data = _objects(run_root, wandb=True)
    trainer.algorithm.name = "my-method"
    trainer.fit(model, data)
    state = json.loads((trainer.run_dir / "wandb.json").read_text())
    assert state["name"] == "my-method-synthetic-K8-rho0.5-s3"
    assert state["group"] == "synthetic-K8-rho0.5"


class _KillAt:
    """Interrupts the fit in the first round of a stage (as Ctrl-C would)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def on_round_end(self, trainer, info, metrics):
        if info.stage == self.stage:
            raise KeyboardInterrupt


def test_csv_keeps_the_history_of_a_fit_killed_at_stage_3_and_resumed(run_root, capsys):
    from fedshard_lightning.callbacks import FederatedCallback

    kill = type("Kill", (_KillAt, FederatedCallback), {})(3)
    trainer, model, data = _objects(run_root, callbacks=[kill])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(model, data)
    run = trainer.run_dir
    assert (
        f"resume with: FederatedTrainer(...same settings...).fit(model, datamodule, ckpt_path='{run}')"
        in (capsys.readouterr().err)
    )
    killed = list(_rows(run / "logs" / "metrics.csv"))
    assert {float(r["stage"]) for r in killed if r["stage"]} == {1, 2, 3}, "flushed every round"

    trainer, model, data = _objects(run_root)
    trainer.fit(model, data, ckpt_path=str(run))
    rows = [r for r in _rows(run / "logs" / "metrics.csv") if r["round"]]
    stages = [int(float(r["stage"])) for r in rows]
    assert stages == sorted(stages) and set(stages) == {1, 2, 3}
    assert len(rows) == len({(r["stage"], r["round"]) for r in rows}), "no round logged twice"
    steps = [int(float(r["step"])) for r in rows]
    assert steps == list(range(len(rows))), "one global step per round across the resume"
    assert not (run / "logs" / "fit-1").exists()


def _tensorboard_events(log_dir):
    """(hparams, {tag: [(step, value)]}) read back from a TensorBoard event directory."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    hparams = {}
    for key, value in start.hparams.items():
        kind = value.WhichOneof("kind")
        hparams[key] = getattr(value, kind)
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return hparams, scalars


def test_tensorboard_events_hold_the_settings_rounds_and_request(run_root):
    pytest.importorskip("tensorboard")
    trainer, model, data = _objects(run_root, tensorboard=True)
    trainer.fit(model, data)
    run = trainer.run_dir
    trainer2, model2, data2 = _objects(run_root, tensorboard=True)
    report = trainer2.unlearn(model2, data2, ckpt_path=str(run), clients=[2])

    hparams, scalars = _tensorboard_events(run / "tensorboard" / "fit")
    for key, value in {"method": "fedshard", "num_clients": 8, "rho": 0.5, "lr": 0.1, "seed": 3}.items():
        assert hparams[key] == (value if isinstance(value, str) else pytest.approx(value)), key
    rounds = _rows(run / "logs" / "metrics.csv")
    losses = [(int(r["step"]), float(r["train_loss"])) for r in rounds if r["train_loss"]]
    assert [s for s, _ in scalars["train_loss"]] == [s for s, _ in losses], "one point per round, as the CSV"
    assert [v for _, v in scalars["train_loss"]] == pytest.approx([v for _, v in losses], rel=1e-6)

    hparams, scalars = _tensorboard_events(run / "tensorboard" / "unlearn-1")
    assert hparams["method"] == "fedshard"
    assert scalars["unlearn/client_steps"][0][1] == report["client_steps"]
    assert scalars["unlearn/test_accuracy_after"][0][1] == pytest.approx(report["test_accuracy_after"])


def test_tensorboard_missing_is_one_line_naming_the_extra(run_root, monkeypatch):
    from lightning.fabric.loggers import tensorboard as tb

    from fedshard_lightning.errors import ConfigError

    monkeypatch.setattr(tb, "_TENSORBOARD_AVAILABLE", False)
    for tbx in (False, True):  # torch.utils.tensorboard, which writes the settings, needs tensorboard
        monkeypatch.setattr(tb, "_TENSORBOARDX_AVAILABLE", tbx)
        trainer, model, data = _objects(run_root, tensorboard=True)
        alone = r" \(tensorboardX alone is not enough\)" if tbx else ""
        with pytest.raises(ConfigError, match=rf"the tensorboard package is not available{alone};.*\[tb\]"):
            trainer.fit(model, data)
        assert not list(run_root.iterdir()), "the failed run left no directory behind"


def test_requests_are_logged_after_the_fit_without_wandb(run_root):
    """Without W&B, each request's row still follows the run's last step (CSV and TensorBoard alike).

    Reference: the steps read back from the CSV files with the csv module, not from the package.
    """
    trainer, model, data = _objects(run_root)
    trainer.fit(model, data)
    run = trainer.run_dir
    last_fit_step = max(int(float(r["step"])) for r in _rows(run / "logs" / "metrics.csv"))
    for n, clients in enumerate(([2], [5]), start=1):
        trainer, model, data = _objects(run_root)
        trainer.unlearn(model, data, ckpt_path=str(run), clients=clients)
        steps = [int(float(r["step"])) for r in _rows(run / "logs" / f"unlearn-{n}" / "metrics.csv")]
        # the request's row, then the fairness of the clients that remain, at the same step
        assert steps == [last_fit_step + n] * 2, f"request {n}: one step after the run's last"


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, not even ``finally`` blocks that log."""


def test_a_request_killed_after_its_commit_is_logged_by_the_next_unlearn(run_root, monkeypatch):
    """Killed between the cache commit and its row, a request is applied but was never logged.

    Reference: the request reports in ``unlearning/NNNN/report.json`` and the rows read back with
    the csv module: one row per request, in request order, at consecutive steps after the fit.
    """
    import fedshard_lightning.trainer.trainer as trainer_module

    trainer, model, data = _objects(run_root)
    trainer.fit(model, data)
    run = trainer.run_dir
    last_fit_step = max(int(float(r["step"])) for r in _rows(run / "logs" / "metrics.csv"))
    real_hook = trainer_module.call_hook

    def killed_at_unlearn_end(fabric, hook, *args, **kwargs):
        if hook == "on_unlearn_end":
            raise _Killed
        return real_hook(fabric, hook, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "call_hook", killed_at_unlearn_end)
    trainer, model, data = _objects(run_root)
    with pytest.raises(_Killed):
        trainer.unlearn(model, data, ckpt_path=str(run), clients=[2])
    monkeypatch.setattr(trainer_module, "call_hook", real_hook)
    assert (run / "unlearning" / "0001" / "report.json").is_file(), "the request was committed"

    for clients in ([2], [5]):  # the repeat is a no-op; a new request follows
        trainer, model, data = _objects(run_root)
        trainer.unlearn(model, data, ckpt_path=str(run), clients=clients)
    rows = [r for path in sorted(run.glob("logs/unlearn-*/metrics.csv")) for r in _rows(path)]
    rows = [r for r in rows if r.get("unlearn/request")]  # not the fairness rows after them
    reports = [json.loads((run / "unlearning" / f"{n:04d}" / "report.json").read_text()) for n in (1, 2)]
    assert [int(float(r["unlearn/request"])) for r in rows] == [1, 2], "each request logged once"
    assert [float(r["unlearn/client_steps"]) for r in rows] == [rep["client_steps"] for rep in reports]
    assert [int(float(r["step"])) for r in rows] == [last_fit_step + 1, last_fit_step + 2]


def test_tensorboard_of_a_fit_killed_at_stage_3_and_resumed_has_one_point_per_round(run_root):
    """The killed fit's points of the stage it did not commit are dropped, as in the CSV.

    Reference: the CSV's steps (read with the csv module) against TensorBoard's own reader.
    """
    pytest.importorskip("tensorboard")
    from fedshard_lightning.callbacks import FederatedCallback

    kill = type("Kill", (_KillAt, FederatedCallback), {})(3)
    trainer, model, data = _objects(run_root, callbacks=[kill], tensorboard=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(model, data)
    run = trainer.run_dir
    trainer, model, data = _objects(run_root, tensorboard=True)
    trainer.fit(model, data, ckpt_path=str(run))
    steps = [int(float(r["step"])) for r in _rows(run / "logs" / "metrics.csv") if r["train_loss"]]
    _, scalars = _tensorboard_events(run / "tensorboard" / "fit")
    assert [s for s, _ in scalars["train_loss"]] == steps, "each round once, as in the CSV"


def test_audit_and_test_log_their_result_after_the_run_s_last_step(run_root):
    """``audit`` and ``test`` on a run each add one row (CSV, W&B) and close the W&B run.

    Reference: the rows read back with the csv module and from W&B's own offline files, and the
    accuracy and verdict the commands return.
    """
    import wandb

    trainer, model, data = _objects(run_root, wandb=True)
    trainer.fit(model, data)
    run = trainer.run_dir
    trainer, model, data = _objects(run_root, wandb=True)
    trainer.unlearn(model, data, ckpt_path=str(run), clients=[2])
    last = max(int(float(r["step"])) for r in _rows(run / "logs" / "unlearn-1" / "metrics.csv"))
    trainer, model, data = _objects(run_root, wandb=True)
    verdict = trainer.audit(model, data, str(run))
    assert wandb.run is None, "audit left its W&B run open"
    trainer, model, data = _objects(run_root, wandb=True)
    metrics = trainer.test(model, data, str(run))
    assert wandb.run is None, "test left its W&B run open"

    (audit_row,) = _rows(run / "logs" / "audit-1" / "metrics.csv")
    (test_row,) = _rows(run / "logs" / "test-1" / "metrics.csv")
    assert int(float(audit_row["step"])) == last + 1 and int(float(test_row["step"])) == last + 2
    assert float(audit_row["audit/passed"]) == 1.0 and verdict["passed"]
    assert float(audit_row["audit/max_abs_diff"]) == verdict["max_abs_diff"] == 0.0
    assert float(test_row["test/test_accuracy"]) == pytest.approx(metrics["test_accuracy"])
    _, history, _ = _wandb_items(run)
    assert any(h.get("audit/passed") == 1.0 for h in history)
    assert any(h.get("test/test_accuracy") == pytest.approx(metrics["test_accuracy"]) for h in history)


def _segments(run_dir):
    """(run record or None, history rows) of every offline segment, in the order they started.

    Read from W&B's own offline files, not from the package.
    """
    from callbacks.test_replay import _wandb_records

    out = []
    for path in (run_dir / "wandb_files" / "wandb").glob("offline-run-*/run-*.wandb"):
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
    return sorted(out, key=lambda s: s[0].start_time.ToMicroseconds() if s[0] is not None else 0)


def _synced_history(run_dir):
    """History rows as ``wandb sync`` (0.31) would upload them: the segments under ``wandb/offline-run-*``
    in the order they started, each appended after the last (W&B renumbers a resumed segment's ``_step``).
    """
    return [row for _, rows in _segments(run_dir) for row in rows]


@pytest.mark.parametrize("killed_by", ["interrupt", "sigkill"])
def test_wandb_history_of_a_fit_killed_at_stage_3_and_resumed_equals_the_csv(run_root, killed_by):
    """Every row of the CSV once, in order, in the synced W&B run; none of the retrained stage twice.

    ``interrupt`` (Ctrl-C, SIGTERM): the killed segment holds the rounds of stage 3, which the
    resumed fit trains again. ``sigkill``: W&B's service dies with the process before it flushes
    its file, which keeps only its 7-byte header (measured with wandb 0.31). Reference: the rows
    of ``logs/metrics.csv`` read with the csv module.
    """
    import wandb

    from fedshard_lightning.callbacks import FederatedCallback

    kill = type("Kill", (_KillAt, FederatedCallback), {})(3)
    trainer, model, data = _objects(run_root, callbacks=[kill], wandb=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(model, data)
    left_open = wandb.run is not None
    if left_open:
        wandb.finish()  # as the process's exit would
    run = trainer.run_dir
    if killed_by == "sigkill":
        for path in (run / "wandb_files" / "wandb").glob("offline-run-*/run-*.wandb"):
            path.write_bytes(path.read_bytes()[:7])
    trainer, model, data = _objects(run_root, wandb=True)
    trainer.fit(model, data, ckpt_path=str(run))

    csv_rows = [
        (
            int(float(r["step"])),
            {k: float({"True": 1, "False": 0}.get(v, v)) for k, v in r.items() if k != "step" and v != ""},
        )
        for r in _rows(run / "logs" / "metrics.csv")
    ]

    def scalars(
        h,
    ):  # W&B's own keys and media (a table's or histogram's KEY/_type, KEY/...) are not CSV columns
        media = tuple(k.removesuffix("_type") for k in h if k.endswith("/_type"))
        return {k: v for k, v in h.items() if not k.startswith(("_", "trainer/", *media))}

    synced = [(h["trainer/global_step"], scalars(h)) for h in _synced_history(run)]
    assert [s for s, _ in synced] == [s for s, _ in csv_rows], "the CSV's steps, each row once, in order"
    for (_, got), (_, want) in zip(synced, csv_rows):
        assert set(got) == set(want)
        assert [got[k] for k in want] == pytest.approx([want[k] for k in want], rel=1e-12)
    rounds = [(h["stage"], h["round"]) for _, h in synced if "round" in h]
    assert len(rounds) == len(set(rounds)) == 2 * 3, "2 rounds in each of 3 stages"
    assert not left_open, "the interrupted fit closed its W&B run (a resume in this process needs a new one)"


def test_a_command_that_leaves_its_wandb_run_open_does_not_take_the_next_run_s_rows(run_root):
    """In one process: fit A, a repeated (no-op) unlearn on A, then fit B: B's rows go to B's W&B run.

    Lightning's WandbLogger logs into any open W&B run; the no-op unlearn had left A's open, so
    B's fit wrote its rounds into A's run and B's own W&B run stayed empty. Reference: each run
    directory's W&B id (``wandb.json``) and its CSV rows (csv module) against W&B's offline files.
    """
    from callbacks.test_replay import _wandb_records

    trainer, model, data = _objects(run_root, wandb=True)
    trainer.fit(model, data)
    a = trainer.run_dir
    for _ in range(2):  # the second asks again for client 2: nothing to do
        trainer, model, data = _objects(run_root, wandb=True)
        trainer.unlearn(model, data, ckpt_path=str(a), clients=[2])
    trainer, model, data = _objects(run_root, wandb=True, seed=4)
    trainer.fit(model, data)
    b = trainer.run_dir
    for run in (a, b):
        own = json.loads((run / "wandb.json").read_text())["id"]
        ids, rounds = set(), 0
        for path in (run / "wandb_files" / "wandb").glob("offline-run-*/run-*.wandb"):
            for record in _wandb_records(path):
                kind = record.WhichOneof("record_type")
                ids |= {record.run.run_id} if kind == "run" else set()
                rounds += kind == "history" and any(
                    (i.key or "/".join(i.nested_key)) == "round" for i in record.history.item
                )
        csv_rounds = sum(1 for r in _rows(run / "logs" / "metrics.csv") if r["round"])
        assert ids == {own} and rounds == csv_rounds, run.name


def test_a_refused_resume_of_a_run_with_requests_leaves_its_wandb_segments_alone(run_root):
    """``fit --ckpt_path`` on a run that has unlearning requests stops; the fit's W&B rows stay to be synced.

    Reference: the fit's rows read back from the offline files under ``wandb/offline-run-*``.
    """
    from fedshard_lightning.errors import CacheError

    trainer, model, data = _objects(run_root, wandb=True)
    trainer.fit(model, data)
    run = trainer.run_dir
    trainer, model, data = _objects(run_root, wandb=True)
    trainer.unlearn(model, data, ckpt_path=str(run), clients=[2])
    trainer, model, data = _objects(run_root, wandb=True)
    with pytest.raises(CacheError, match="cannot be resumed"):
        trainer.fit(model, data, ckpt_path=str(run))
    rounds = [h for h in _synced_history(run) if "round" in h]
    assert len(rounds) == sum(1 for r in _rows(run / "logs" / "metrics.csv") if r["round"])
    assert not (run / "wandb_files" / "superseded").exists()
