"""A client optimizer with state (Adam's moments, SGD's momentum) is reset every round, and fit says so once."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_data, tiny_trainer

from fedshard_lightning.models import MLP


@pytest.mark.parametrize(
    "kw,named",
    [
        (dict(optimizer="adamw", lr=0.01, weight_decay=0.05), "AdamW keeps state (exp_avg, exp_avg_sq)"),
        (dict(optimizer="sgd", lr=0.1, momentum=0.5), "SGD keeps state (momentum_buffer)"),
        (dict(optimizer="sgd", lr=0.1), None),
    ],
)
def test_fit_names_the_state_that_each_round_resets(tmp_path, capsys, kw, named):
    torch.manual_seed(0)
    tiny_trainer(tmp_path).fit(MLP(hidden=(8,), **kw), tiny_data())
    notes = [line for line in capsys.readouterr().out.splitlines() if "reset every round" in line]
    if named is None:
        assert notes == []
    else:
        assert len(notes) == 1 and named in notes[0], notes
