"""Progress: plain per-stage lines with an ETA off a terminal, the request line of unlearn."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from _tiny import small_synthetic

from fedshard_lightning import FederatedTrainer
from fedshard_lightning.callbacks import ProgressBar
from fedshard_lightning.callbacks.progress import format_rate, format_seconds
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedShard


def _objects(root, progress: bool):
    data = small_synthetic()
    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=4),
        default_root_dir=str(root),
        enable_progress_bar=progress,
        vectorize="always",
    )
    return trainer, MLP(hidden=(8,), lr=0.1), data


def test_plain_stage_lines_with_eta_and_the_request_line(run_root, capsys):
    trainer, model, data = _objects(run_root, progress=True)
    trainer.fit(model, data)  # pytest captures stderr: not a terminal
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("fit: stage")]
    assert len(lines) == 3, out
    pattern = r"fit: stage (\d)/3 done · 2 round\(s\) · (\d) group\(s\), 8 clients · [\d.<]+ client-steps/s · .*ETA (\S+)"
    found = [re.match(pattern, x) for x in lines]
    assert all(found), lines
    assert [m.group(1) for m in found] == ["1", "2", "3"] and [m.group(2) for m in found] == ["4", "2", "1"]
    assert found[-1].group(3) == "0s"
    assert re.search(r"fit done: .* seconds=[\d.]+ \(total [\d.]+ with callbacks and logging\)", out)

    trainer, model, data = _objects(run_root, progress=False)
    trainer.unlearn(model, data, ckpt_path=str(trainer.default_root_dir + "/version_0"), clients=[1])
    out = capsys.readouterr().out
    assert re.search(
        r"unlearn: request 0001, clients \[1\]: \d+ client-steps predicted .* ETA ~\d+s at the fit's", out
    ), out


@pytest.mark.parametrize(("every", "want"), [(0.0, 2), (30.0, 0)])
def test_plain_round_lines_within_a_long_stage(run_root, capsys, every, want):
    """Off a terminal a stage's rounds print at most every ``plain_every_s`` (not its last round)."""
    data = small_synthetic()
    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=3, batch_size=4),
        default_root_dir=str(run_root),
        callbacks=[ProgressBar(plain_every_s=every)],
        vectorize="always",
    )
    trainer.fit(MLP(hidden=(8,), lr=0.1), data)
    out = capsys.readouterr().out
    rounds = [x for x in out.splitlines() if x.startswith("fit: stage") and " done " not in x]
    assert len(rounds) == 3 * want, out
    pattern = r"fit: stage (\d)/3 · round (\d)/3 · \d group\(s\), 8 clients · [\d.<]+ client-steps/s · ETA \S+ · elapsed \S+$"
    found = [re.match(pattern, x) for x in rounds]
    assert all(found), rounds
    assert [(m.group(1), m.group(2)) for m in found] == [(st, r) for st in "123" for r in "12"][: len(found)]
    assert len([x for x in out.splitlines() if " done " in x and x.startswith("fit: stage")]) == 3


def test_eta_is_none_before_anything_ran_and_counts_remaining_stages(monkeypatch):
    import fedshard_lightning.callbacks.progress as progress

    monkeypatch.setattr(progress, "time", SimpleNamespace(perf_counter=lambda: 100.0))  # the test's clock
    bar = ProgressBar()
    assert bar.eta() is None
    bar._t0, bar._planned, bar._stage, bar._stages_done, bar._rounds, bar._round = 0.0, 4, 2, 2, 5, 5
    bar._t0, bar._stage_t0 = 80.0, 100.0  # two stages in 20 s, two to go
    assert bar.eta() == pytest.approx(20.0)


def test_format_rate_keeps_slow_rates_visible():
    assert [format_rate(x) for x in (0.0, 0.004, 0.4, 0.043, 3.46, 9.96, 12.4, 900.2)] == [
        "0",
        "<0.01",
        "0.4",
        "0.043",
        "3.5",
        "10",
        "12",
        "900",
    ]


def test_format_seconds():
    assert [format_seconds(x) for x in (0.4, 42, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]


def _stage_lines(out, task):
    pattern = (
        rf"{task}: stage (\d)/3 · (\d) shard\(s\), (\d) clients · (\d+)/(\d+) client-steps · "
        r"[\d.<]+ client-steps/s · elapsed \S+ · ETA (\S+)"
    )
    lines = [x for x in out.splitlines() if x.startswith(f"{task}: stage")]
    return lines, [re.fullmatch(pattern, x) for x in lines]


def test_unlearn_and_audit_print_one_line_per_stage_off_a_terminal(run_root, capsys):
    trainer, model, data = _objects(run_root, progress=False)
    trainer.fit(model, data)
    run = str(trainer.run_dir)
    capsys.readouterr()

    trainer, model, data = _objects(run_root, progress=True)
    report = trainer.unlearn(model, data, ckpt_path=run, clients=[1])
    lines, found = _stage_lines(capsys.readouterr().out, "unlearn")
    assert lines and all(found), lines
    stages = [int(m.group(1)) for m in found]
    assert stages == sorted(stages) and stages[-1] == 3, "one line per retrained stage, bottom-up"
    done = [int(m.group(4)) for m in found]
    assert done[-1] == report["client_steps"] and {int(m.group(5)) for m in found} == {
        report["predicted_client_steps"]
    }
    assert found[-1].group(6) == "0s"

    trainer, model, data = _objects(run_root, progress=True)
    result = trainer.audit(model, data, ckpt_path=run)
    lines, found = _stage_lines(capsys.readouterr().out, "audit")
    assert [int(m.group(1)) for m in found] == [1, 2, 3], lines
    assert [int(m.group(2)) for m in found] == [4, 2, 1]  # every shard is replayed
    assert result["passed"] and int(found[-1].group(4)) == int(found[-1].group(5))

    trainer, model, data = _objects(run_root, progress=False)
    trainer.unlearn(model, data, ckpt_path=run, clients=[2])
    assert "unlearn: stage" not in capsys.readouterr().out, "enable_progress_bar false: quiet"


def test_replay_prints_one_line_per_request_and_fit_total_includes_it(run_root, capsys):
    from fedshard_lightning.callbacks import UnlearningReplay

    trainer, model, data = _objects(run_root, progress=True)
    trainer.user_callbacks = [UnlearningReplay(mode="measured", clients=[0, 3, 5], mia=False, plots=False)]
    trainer.fit(model, data)
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("replay: ")]
    pattern = r"replay: request (\d)/3 \(client (\d)\) · (\d+)/(\d+) client-steps · .* ETA (\S+)"
    found = [re.fullmatch(pattern, x) for x in lines]
    assert len(lines) == 3 and all(found), lines
    assert [m.group(2) for m in found] == ["0", "3", "5"]
    assert found[-1].group(3) == found[-1].group(4), "the replay's predicted costs were its costs"
    # The replay runs inside fit's on_fit_end: the printed total includes it, fit's seconds do not.
    done = re.search(r"seconds=([\d.]+) \(total ([\d.]+) with callbacks", out)
    replay_seconds = trainer.user_callbacks[0].summary["replay_seconds"]
    assert float(done.group(2)) >= float(done.group(1)) + replay_seconds - 0.1


def test_task_progress_eta_and_throttled_plain_lines(capsys):
    from fedshard_lightning.callbacks import TaskProgress

    p = TaskProgress("unlearn", 100, live=False, plain=True)
    assert p.eta() is None
    p.t0 -= 10.0  # 10 s spent
    p.update(25, "round 1/8", force=False)
    assert p.eta() == pytest.approx(30.0, rel=0.05)  # 75 steps left at 2.5 steps/s
    p.update(2, "round 2/8", force=False)  # same tenth, well under 30 s: no line
    p.update(10, "round 3/8", force=False)
    lines = capsys.readouterr().out.splitlines()
    assert [x.split(" · ")[0] for x in lines] == ["unlearn: round 1/8", "unlearn: round 3/8"]
    q = TaskProgress("compare", None, live=False, plain=True, items=4)
    q.t0 -= 8.0
    q.update(50, "method 1/4", item=True)
    assert q.eta() == pytest.approx(24.0, rel=0.05)  # 3 methods left at 8 s each


def test_task_progress_rate_leaves_out_the_start_up():
    """After a second report the rate runs from the first one: start-up paid by stage 1 does not count."""
    from fedshard_lightning.callbacks import TaskProgress

    p = TaskProgress("unlearn", 100, live=False, plain=False)
    p.t0 -= 10.0  # stage 1: 10 steps, but 10 s with the start-up
    p.update(10, "stage 1/3")
    assert p.eta() == pytest.approx(90.0, rel=0.05)  # one report: the overall rate, 1 step/s
    p.first = (p.first[0] - 1.0, p.first[1])  # stage 2: 40 steps in the next second
    p.update(40, "stage 2/3")
    assert p.eta() == pytest.approx(1.25, rel=0.05)  # 50 steps left at 40 steps/s
