"""Progress: plain per-stage lines with an ETA off a terminal, the request line of unlearn."""

from __future__ import annotations

import re

from _tiny import small_synthetic

from fedshard_lightning import FederatedTrainer
from fedshard_lightning.callbacks import ProgressBar
from fedshard_lightning.callbacks.progress import format_seconds
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
    pattern = r"fit: stage (\d)/3 done · 2 round\(s\) · (\d) group\(s\), 8 clients · \d+ client-steps/s · .*ETA (\S+)"
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


def test_eta_is_none_before_anything_ran_and_counts_remaining_stages():
    bar = ProgressBar()
    assert bar.eta() is None
    bar._t0, bar._planned, bar._stage, bar._stages_done, bar._rounds, bar._round = 0.0, 4, 2, 2, 5, 5
    import time

    now = time.perf_counter()
    bar._t0, bar._stage_t0 = now - 20.0, now  # two stages in 20 s, two to go
    assert abs(bar.eta() - 20.0) < 1.0


def test_format_seconds():
    assert [format_seconds(x) for x in (0.4, 42, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]
