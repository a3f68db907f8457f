"""``vectorize: auto`` times the two paths once per model signature, in the process and across processes."""

from __future__ import annotations

import json

import pytest
from _tiny import tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.engine import path_choice
from fedshard_lightning.models import MLP


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

    import numpy as np
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
