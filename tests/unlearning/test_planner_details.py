"""``Planner.unlearn_details``: what a request's report says besides its costs, checked like every planner call."""

from __future__ import annotations

import pytest
from test_planner_sisa import SISA, _fit, _unlearn

from fedshard_lightning.errors import ContractError


class NamesShards(SISA):
    def unlearn_details(self, state, new, clients, plans):
        return {
            "retrained_shards": sorted({c % self.shards for c in clients}),
            "before": list(state.unlearned),
        }


class ListDetails(SISA):
    def unlearn_details(self, state, new, clients, plans):
        return ["retrained"]


def test_the_details_come_from_the_state_before_the_request_and_reach_the_report(run_root):
    run = _fit(run_root, NamesShards(batch_size=4)).run_dir
    first = _unlearn(run_root, run, [1, 3], NamesShards(batch_size=4))
    assert first["retrained_shards"] == [0, 1] and first["before"] == []
    second = _unlearn(run_root, run, [2], NamesShards(batch_size=4))
    assert second["retrained_shards"] == [2] and second["before"] == [1, 3]


def test_details_that_are_no_dict_stop_in_one_line(run_root):
    run = _fit(run_root, ListDetails(batch_size=4)).run_dir
    with pytest.raises(
        ContractError, match=r"ListDetails\.unlearn_details\(\) must return a dict with str keys"
    ):
        _unlearn(run_root, run, [1], ListDetails(batch_size=4))
