"""Live lines fit the terminal: the least useful parts go first, never the position or the ETA."""

from __future__ import annotations

from _tiny import small_synthetic

from fedshard_lightning import FederatedTrainer
from fedshard_lightning.callbacks import ProgressBar, TaskProgress
from fedshard_lightning.callbacks.line_fit import fit_line
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedShard

PARTS = [("stage 3/5", 0), ("round 12/20", 0), ("4 group(s), 32 clients", 4), ("900 client-steps/s", 3)]
PARTS += [("loss 0.123 acc 0.931", 1), ("ETA 3m05s", 0), ("elapsed 1m02s", 2)]


def test_fit_line_leaves_out_the_highest_ranks_first():
    full = " · ".join(t for t, _ in PARTS)
    assert fit_line(PARTS, len(full)) == full
    # each narrower width drops the next part by rank: groups (4), rate (3), elapsed (2), loss (1)
    assert fit_line(PARTS, len(full) - 1) == (
        "stage 3/5 · round 12/20 · 900 client-steps/s · loss 0.123 acc 0.931 · ETA 3m05s · elapsed 1m02s"
    )
    assert fit_line(PARTS, 79) == "stage 3/5 · round 12/20 · loss 0.123 acc 0.931 · ETA 3m05s · elapsed 1m02s"
    assert fit_line(PARTS, 60) == "stage 3/5 · round 12/20 · loss 0.123 acc 0.931 · ETA 3m05s"
    assert fit_line(PARTS, 40) == "stage 3/5 · round 12/20 · ETA 3m05s"
    assert fit_line(PARTS, 20) == "stage 3/5 · round 1…"  # rank 0 alone too wide: cut, 20 columns
    assert len(fit_line(PARTS, 20)) == 20
    assert fit_line([("a", 0), ("", 1), ("b", 0)], 80) == "a · b"  # empty parts leave no separator


def test_fit_progress_on_an_80_column_terminal_keeps_round_and_eta(run_root, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # rich reads the width when the console is made
    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=4),
        default_root_dir=str(run_root),
        callbacks=[ProgressBar(force=True)],
        vectorize="always",
    )
    trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("stage ")]
    assert lines, err
    assert all(len(x) <= 80 for x in lines), lines
    assert all("round 2/2" in x and "ETA " in x and "loss " in x for x in lines), lines
    assert not [x for x in err.splitlines() if "…" in x], err  # nothing cropped by rich


def test_task_progress_live_line_leaves_room_for_its_bar():
    p = TaskProgress("unlearn", 1000, live=False, plain=False)
    p.update(250, "stage 2/5 · 3 shard(s), 24 clients")
    full = p.line("stage 2/5 · 3 shard(s), 24 clients")
    assert len(full) > 80
    line = p.live_line("stage 2/5 · 3 shard(s), 24 clients", 80)
    assert len(line) <= 80 - 20 - 2
    assert line.startswith("unlearn: stage 2/5 · 3 shard(s), 24 clients") and " · ETA " in line
    wide = p.live_line("stage 2/5 · 3 shard(s), 24 clients", 200)  # the rate moves with the clock
    assert wide.count(" · ") == full.count(" · ") and "client-steps/s" in wide
