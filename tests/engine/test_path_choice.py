"""``vectorize: auto`` times the two paths once per model signature, in the process and across processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _tiny import tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.engine import FederatedEngine, path_choice, stack_params
from fedshard_lightning.engine.kernels.base import ClientBatch
from fedshard_lightning.engine.local import LocalTrainer
from fedshard_lightning.engine.neighbours import NEIGHBOUR_STEPS, PROBE_STEPS
from fedshard_lightning.engine.plan_ahead import BatchPlans
from fedshard_lightning.engine.schedule import LocalSchedule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedAvg


@pytest.fixture
def timings(monkeypatch):
    """Count the timing runs (the real ones still run and decide)."""
    calls = []
    real = path_choice.time_paths

    def counted(local, start, batch, *args):
        calls.append(path_choice.path_signature(local, batch))
        return real(local, start, batch, *args)

    monkeypatch.setattr(path_choice, "time_paths", counted)
    return calls


def _fit(root, model=None, **kw):
    trainer = tiny_trainer(root, vectorize="auto", **kw)
    metrics = trainer.fit(model or tiny_model(), tiny_data())
    return trainer, metrics


def test_second_fit_of_the_same_model_does_not_probe(tmp_path, timings, capsys):
    _, m1 = _fit(tmp_path / "a")
    assert len(timings) == 1
    second, m2 = _fit(tmp_path / "b")
    assert len(timings) == 1, "the second fit reused the decision"
    assert m2["vectorize_mode"] == m1["vectorize_mode"]
    out = capsys.readouterr().out
    assert "kept from an earlier fit of this model in this process" in out
    assert "vectorize: auto; timed" in second.algorithm.engine.mode_reason


def test_decision_is_persisted_for_a_new_process_and_keyed_by_signature(tmp_path, timings, monkeypatch):
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "cache"))
    _, m1 = _fit(tmp_path / "a")
    stored = json.loads((tmp_path / "cache" / "vectorize_auto.json").read_text())
    (entry,) = stored.values()
    assert entry["mode"] == m1["vectorize_mode"] and entry["signature"] == timings[0]
    path_choice.decided_paths().clear()  # as a new process starts
    trainer, m2 = _fit(tmp_path / "b")
    assert len(timings) == 1 and m2["vectorize_mode"] == m1["vectorize_mode"]
    assert "kept in" in trainer.algorithm.engine.mode_reason
    # Another architecture is another signature: it is timed.
    _fit(tmp_path / "c", model=MLP(hidden=(24,), lr=0.1))
    assert len(timings) == 2 and timings[1] != timings[0]
    assert len(json.loads((tmp_path / "cache" / "vectorize_auto.json").read_text())) == 2


def test_empty_cache_dir_keeps_decisions_in_the_process_only(tmp_path, timings, monkeypatch):
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    _fit(tmp_path / "a")
    path_choice.decided_paths().clear()
    _fit(tmp_path / "b")
    assert len(timings) == 2
    assert not list(tmp_path.rglob("vectorize_auto.json"))


def test_unreadable_cache_file_is_timed_again(tmp_path, timings, monkeypatch):
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "vectorize_auto.json").write_text("{not json")
    _fit(tmp_path / "a")
    assert len(timings) == 1
    assert len(json.loads((tmp_path / "cache" / "vectorize_auto.json").read_text())) == 1


@pytest.mark.parametrize(
    ("stacked", "loop", "want"),
    [
        ([1.0, 2.0, 9.0], [1.0, 2.0], 0.0),  # only the clients both ran count
        ([1.0, 2.5], [1.0, 2.0], 0.25),  # relative to the largest loop loss
        ([float("nan"), 2.0], [float("nan"), 2.0], 0.0),  # diverged on both: training reports it
        ([float("inf"), 2.0], [float("inf"), 2.1], 0.1 / 2.1),
        ([float("nan"), 2.0], [1.0, 2.0], float("inf")),  # finite on one path only
        ([float("nan")], [float("nan")], 0.0),
    ],
)
def test_disagreement_against_the_formula(stacked, loop, want):
    import math

    import torch

    from fedshard_lightning.engine.kernels.loop import LocalResult

    def res(v):
        return LocalResult({}, np.ones(len(v), dtype=np.int64), torch.tensor(v, dtype=torch.float32))

    got = path_choice.disagreement(res(stacked), res(loop))
    assert got == want or math.isclose(got, want, rel_tol=1e-6)


def test_the_probe_says_what_it_does_and_when_it_is_done(tmp_path, timings, capsys):
    path_choice.decided_paths().clear()
    _fit(tmp_path / "a")
    lines = capsys.readouterr().out.splitlines()
    probe = [line for line in lines if line.startswith("vectorize: auto: ")]
    assert probe[0].startswith("vectorize: auto: timing the stacked path against the per-client loop")
    assert any("ms/client; now the stacked path on" in line for line in probe)
    assert probe[-1].startswith("vectorize: auto: done in ")
    mode = next(i for i, line in enumerate(lines) if line.startswith("local training:"))
    assert lines.index(probe[-1]) < mode  # the progress comes before the decision


def test_budget_is_10s_or_2_percent_of_the_predicted_call():
    assert path_choice.probe_budget(None, 1.0) == 10.0
    assert path_choice.probe_budget(1000, 1e-3) == 10.0  # a 1 s call: the 10 s floor
    assert path_choice.probe_budget(100_000, 0.01) == pytest.approx(20.0)  # a 1000 s call


def test_a_spent_budget_times_once_on_fewer_stacked_clients(tmp_path, timings, monkeypatch):
    path_choice.decided_paths().clear()
    monkeypatch.setattr(path_choice, "BUDGET_S", 0.0)  # every model is "slow"
    trainer, _ = _fit(tmp_path / "a")
    reason = trainer.algorithm.engine.mode_reason
    assert "(1 timing(s) in " in reason
    assert trainer.algorithm.engine.probe_seconds > 0


def test_the_probe_trains_the_first_steps_of_a_round_not_all_of_it(tmp_path, monkeypatch):
    """The probe's batches come from the trainer's batch plans, so it must cut those.

    With the schedule alone shortened, every probe run trained a whole round (here 3 epochs of
    a client's data, 12 steps); on a CNN that made the probe minutes instead of seconds.
    """
    path_choice.decided_paths().clear()
    probing, steps = [False], []
    real_time, real_schedules = path_choice.time_paths, LocalTrainer.schedules

    def timed(*args, **kwargs):
        probing[0] = True
        try:
            return real_time(*args, **kwargs)
        finally:
            probing[0] = False

    def schedules(self, batch):
        planned = real_schedules(self, batch)
        if probing[0]:
            steps.extend(planned[2].tolist())
        return planned

    monkeypatch.setattr(path_choice, "time_paths", timed)
    monkeypatch.setattr(LocalTrainer, "schedules", schedules)
    data = tiny_data(partition="iid")  # 8 clients of 20 samples: 4 batches of 5 per epoch
    algorithm = FedAvg(rounds=1, batch_size=5, local_epochs=3)
    trainer = FederatedTrainer(
        algorithm=algorithm, default_root_dir=str(tmp_path), vectorize="auto", enable_progress_bar=False
    )
    metrics = trainer.fit(tiny_model(), data)
    assert PROBE_STEPS in steps, "the timings ran"
    assert set(steps) <= {PROBE_STEPS, NEIGHBOUR_STEPS}, "no probe run trained the whole round"
    assert metrics["client_steps"] == 8 * 12, "training itself ran the whole rounds"
    assert not trainer.algorithm.engine.local.plans._cut  # the engine's own plans are back


def test_plans_cut_to_the_first_steps_are_the_rounds_start_and_kept_apart():
    own = [np.arange(i * 23, (i + 1) * 23) for i in range(3)]
    plans = BatchPlans(LocalSchedule(batch_size=5, local_epochs=3), 0, own)
    plans.expect([0, 1, 2], [0, 0, 0], 0, 4)
    cut = plans.first_steps(2)
    batch = ClientBatch([0, 1, 2], [0, 0, 0], 0, 0)
    short, full = cut(batch), BatchPlans(LocalSchedule(batch_size=5, local_epochs=3), 0, own)(batch)
    assert short[2].tolist() == [2, 2, 2] and full[2].tolist() == [15, 15, 15]
    assert np.array_equal(short[0], full[0][:, :2]) and np.array_equal(short[1], full[1][:, :2])
    assert not cut._ahead and not plans._ahead  # the cut round planned none ahead for training
    assert plans(ClientBatch([0, 1, 2], [0, 0, 0], 0, 1))[2].tolist() == [15, 15, 15]
    assert plans.first_steps(20)(batch)[2].tolist() == [15, 15, 15]  # a short round is all there


def test_the_budget_follows_the_timings_without_one_time_costs(monkeypatch):
    """First runs (kernel building) at 1 s a client, later ones at 1 ms, on an injected clock.

    The first runs predict a budget of 2% of a 10,000 client-step call at their speed (50 s at
    4 steps a run); the first clean timing predicts under 10 s, so the floor, already spent by
    the first runs: no second repeat.
    """
    dm = tiny_data()
    dm.setup()
    model = tiny_model()
    model.bind_data(dm.input_shape, dm.num_classes)
    engine = FederatedEngine(model, dm, LocalSchedule(batch_size=5), seed=1, vectorize="auto")
    start = stack_params([engine.module_params()] * 8)
    clock, runs = [0.0], []

    def timed(fn, start, sub):
        res = fn({k: v[: len(sub.clients)] for k, v in start.items()}, sub)
        runs.append(len(sub.clients))
        clock[0] += (1.0 if len(runs) <= 2 else 1e-3) * len(sub.clients)
        return res, (1.0 if len(runs) <= 2 else 1e-3) * len(sub.clients)

    monkeypatch.setattr(path_choice, "_timed", timed)
    monkeypatch.setattr(path_choice.time, "perf_counter", lambda: clock[0])
    _, reason = path_choice.time_paths(
        engine.local, start, ClientBatch(list(range(8)), [0] * 8, 1, 0), work=10_000
    )
    assert runs[:2] == [2, 8] and sorted(runs[2:]) == [2, 8], "one repeat of both paths, then no more"
    assert "(2 timing(s) in " in reason
