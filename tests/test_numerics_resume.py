"""A fit resumed in another numerical environment continues in the one it started in.

Before, ``numerics.json`` was written only when fit finished and resuming compared nothing: a fit
killed after stage 2 of 3 under 2 threads and resumed under 1 mixed the two (threads change
float32 rounding, docs/unlearning.md), recorded 1, and its later audit failed with "no difference
in the recorded numerical environment". Reference: the same fit run uninterrupted under 2 threads
(its model's bytes), and fit's own thread count.
"""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import StopAfter, tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.models import MLP


def _fit(root, threads, ckpt_path=None, callbacks=None, name=None):
    tr = tiny_trainer(root, vectorize="always", num_threads=threads, callbacks=callbacks, run_name=name)
    tr.fit(tiny_model(MLP), tiny_data((6,), per_client=12, classes=3, partition="iid"), ckpt_path=ckpt_path)
    return tr.run_dir


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_resume_uses_the_interrupted_fits_threads(tmp_path, capsys, restore_threads):
    reference = _fit(tmp_path, 2, name="uninterrupted")
    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path, 2, callbacks=[StopAfter(2)], name="killed")
    run = tmp_path / "killed"
    assert json.loads((run / "numerics.json").read_text())["threads"] == 2  # recorded at the first commit
    caller = torch.get_num_threads()
    _fit(tmp_path, 1, ckpt_path=str(run))
    assert (
        torch.get_num_threads() == caller
    )  # the run's 2 threads were the run's; the caller gets its own back
    out = capsys.readouterr().out
    assert "warning: numerics: threads: fit used 2, this process had 1; using 2" in out
    assert "already complete" not in out  # stage 3 of 3 was trained by the resumed fit
    assert json.loads((run / "numerics.json").read_text())["threads"] == 2
    assert (run / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
