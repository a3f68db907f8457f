"""Client ids of an unlearning request: checked in time linear in their number."""

from __future__ import annotations

import pytest

from fedshard_lightning.errors import UnlearningRequestError
from fedshard_lightning.trainer.requests import validate_clients


class _CountedId(int):
    """A client id that counts the equality tests made on it: ``list.count`` per id makes n - 1 each."""

    eq_calls = 0

    def __eq__(self, other):
        _CountedId.eq_calls += 1
        return int.__eq__(self, other)

    __hash__ = int.__hash__


def test_a_request_of_many_clients_is_checked_in_linear_time(monkeypatch):
    """A duplicate check by ``list.count`` per id compares every pair (n^2 equality tests, 17 s at
    50 000 ids); a linear one hashes each id and compares at most a few. Counted, not timed."""
    n = 5_000
    monkeypatch.setattr(_CountedId, "eq_calls", 0)
    ids = [_CountedId(i) for i in range(n)][::-1]
    got = validate_clients(ids, n)
    assert _CountedId.eq_calls <= n, _CountedId.eq_calls  # quadratic: about n^2 = 25e6
    assert got == sorted(range(n))  # reference: Python's sort of the same ids


def test_duplicates_are_named_once_each_in_order():
    with pytest.raises(UnlearningRequestError, match=r"duplicate ids \[3, 9\]"):
        validate_clients([9, 3, 1, 3, 9, 9], 10)


def _fedavg_fit(root, exclude):
    from _tiny import small_synthetic

    from fedshard_lightning import FederatedTrainer
    from fedshard_lightning.models import MLP
    from fedshard_lightning.unlearning import FedAvg

    trainer = FederatedTrainer(
        algorithm=FedAvg(rounds=2, batch_size=4), default_root_dir=str(root), enable_progress_bar=False
    )
    return trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic(), exclude_clients=exclude)


@pytest.mark.parametrize(
    ("exclude", "message"),
    [
        ([99], r"exclude_clients: unknown client id 99 \(valid ids: 0\.\.7\)"),
        ([3, 3], r"exclude_clients: duplicate ids \[3\]"),
        (list(range(8)), r"exclude_clients: .*every client"),
    ],
)
def test_fit_refuses_exclusions_that_unlearn_would_refuse(run_root, exclude, message):
    """``[99]`` of 8 clients had trained on all 8, ``range(8)`` had trained nobody; both exited 0."""
    with pytest.raises(UnlearningRequestError, match=message):
        _fedavg_fit(run_root, exclude)
    assert not any(run_root.iterdir()), "the refused fit left no run directory"
