"""A resumed fit warns when fit's thread count, reproduced in its processes, oversubscribes the CPU.

The launch checks the threads a process has then; fit's recorded count is set later (for the same
bits). Before, a fit with 2 threads resumed on 1 core (or by 2 processes on 2 cores) ran
oversubscribed without a word (measured: 186 s for 3 stages that a 2-process fit trains in 17 s).
Reference: ``threads * processes`` against cores + load, the rule the launch's own warning applies.
"""

from __future__ import annotations

import os

import pytest
import torch
from _tiny import tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.callbacks import FederatedCallback
from fedshard_lightning.models import MLP


class _StopAfter(FederatedCallback):
    def on_stage_end(self, trainer, stage, metrics) -> None:
        if stage == 1:
            raise KeyboardInterrupt


def _fit(root, threads, ckpt_path=None, callbacks=None):
    tr = tiny_trainer(root, vectorize="always", num_threads=threads, callbacks=callbacks, run_name="run")
    tr.fit(tiny_model(MLP), tiny_data((6,), per_client=12, classes=3, partition="iid"), ckpt_path=ckpt_path)


@pytest.mark.parametrize("cores, load, warned", [(1, 1.0, True), (4, 0.0, False)])
def test_fits_threads_on_too_few_cores_are_named(tmp_path, monkeypatch, capsys, cores, load, warned):
    before = torch.get_num_threads()
    try:
        with pytest.raises(KeyboardInterrupt):
            _fit(tmp_path, 2, callbacks=[_StopAfter()])
        capsys.readouterr()
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        _fit(tmp_path, 1, ckpt_path=str(tmp_path / "run"))  # 1 thread at launch: no warning there
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert (load + 2 * 1 > cores + 1) == warned  # the rule: load + threads x processes against cores + 1
    assert ("oversubscribed" in err) == warned, err
    if warned:
        assert "2 thread(s), fit's count" in err and "--trainer.devices" in err


def test_unlearn_on_a_crowded_machine_warns_once_with_advice_it_can_follow(tmp_path, monkeypatch, capsys):
    """unlearn takes fit's thread count for the same bits, so the launch's "try --trainer.num_threads 1"
    (which unlearn would override) is not given; one line names fit's count instead."""
    before = torch.get_num_threads()
    try:
        _fit(tmp_path, 2)
        capsys.readouterr()
        monkeypatch.setattr(os, "cpu_count", lambda: 1)
        monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
        tr = tiny_trainer(tmp_path, vectorize="always", num_threads=2)  # fit's count: launch had advised 1
        tr.unlearn(
            tiny_model(MLP),
            tiny_data((6,), per_client=12, classes=3, partition="iid"),
            str(tmp_path / "run"),
            [1],
        )
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "oversubscribed" in x]
    assert len(lines) == 1, err
    assert "2 thread(s), fit's count" in lines[0] and "--trainer.num_threads" not in lines[0], lines
