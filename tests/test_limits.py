"""Counts a config gives are bounded: a typo (``t1: 1e21``) stops at start-up in one line."""

from __future__ import annotations

import pytest

from fedshard_lightning.engine import LocalSchedule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.limits import MAX_COUNT, check_count
from fedshard_lightning.sharding.rounds import A2Rounds, AutoRounds, FixedRounds
from fedshard_lightning.unlearning import FedAvg, FedRecover, FedShard, RapidRetrain

ABSURD = 10**21

# (field named in the error, constructor given the count)
FIELDS = [
    ("algorithm.t1", lambda n: FedShard(t0=2, t1=n)),
    ("algorithm.t0", lambda n: FedShard(t0=n, t1=n)),
    ("algorithm.fixed_rounds", lambda n: FedShard(rounds="fixed", fixed_rounds=n)),
    ("algorithm.rounds", lambda n: FedAvg(rounds=n)),
    ("algorithm.unlearn_rounds", lambda n: RapidRetrain(rounds=4, unlearn_rounds=n)),
    ("algorithm.warmup_rounds", lambda n: FedRecover(rounds=4, warmup_rounds=n)),
    ("algorithm.local_epochs", lambda n: LocalSchedule(local_epochs=n)),
    ("algorithm.local_steps", lambda n: LocalSchedule(local_steps=n)),
    ("t1", lambda n: A2Rounds(2, n)),
    ("rounds", lambda n: FixedRounds(n)),
    ("max_rounds", lambda n: AutoRounds(max_rounds=n)),
]


@pytest.mark.parametrize(("field", "make"), FIELDS, ids=[f for f, _ in FIELDS])
def test_an_absurd_count_names_its_field_and_the_range(field, make):
    with pytest.raises(ConfigError) as err:
        make(ABSURD)
    line = str(err.value)
    assert line.startswith(f"{field}={ABSURD}") and "\n" not in line
    assert str(MAX_COUNT) in line


@pytest.mark.parametrize(("field", "make"), FIELDS, ids=[f for f, _ in FIELDS])
def test_the_largest_count_is_accepted(field, make):
    make(MAX_COUNT)  # builds; nothing trains


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "3", None, MAX_COUNT + 1])
def test_check_count_refuses_what_is_not_a_count_in_range(value):
    with pytest.raises(ConfigError, match=r"^x\.n="):
        check_count("x.n", value)


def test_check_count_returns_the_count_and_accepts_null_where_optional():
    assert check_count("x.n", 1) == 1 and check_count("x.n", MAX_COUNT) == MAX_COUNT
    assert check_count("x.n", 0, minimum=0) == 0
    assert check_count("x.n", None, optional=True) is None
    with pytest.raises(ConfigError, match="or null"):
        check_count("x.n", 0, optional=True)
