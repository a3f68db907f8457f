"""Batches planned for several rounds at once equal each round planned alone (bit for bit)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine.kernels.loop import ClientBatch
from fedshard_lightning.engine.plan_ahead import BatchPlans
from fedshard_lightning.engine.schedule import LocalSchedule


def _alone(sched, own, seed, stage, groups, rnd, clients):
    """One client at a time, one round at a time, through the single-client schedule."""
    out = []
    for c, g in zip(clients, groups):
        pos, sizes = sched.batches(len(own[c]), seed, stage, g, rnd, c)
        out.append(([own[c][p[:k]].tolist() for p, k in zip(pos, sizes)], sizes.tolist()))
    return out


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 25), min_size=2, max_size=7),
    b=st.integers(1, 6),
    steps=st.one_of(st.none(), st.integers(1, 5)),
    first=st.integers(0, 3),
    n_rounds=st.integers(1, 5),
    budget=st.sampled_from([1, 50, 1 << 20]),
)
def test_rounds_planned_together_equal_rounds_planned_alone(sizes, b, steps, first, n_rounds, budget):
    sched = LocalSchedule(batch_size=b, local_steps=steps)
    rng = np.random.default_rng(len(sizes))
    perm = rng.permutation(sum(sizes))
    own = np.split(perm, np.cumsum(sizes)[:-1])
    plans = BatchPlans(sched, 11, own, budget=budget)
    clients = [len(sizes) - 1, 0, *range(1, len(sizes) - 1)]
    groups = [c % 2 for c in clients]
    plans.expect(clients, groups, 2, first + n_rounds)
    for r in range(first, first + n_rounds):
        gidx, sz, st_ = plans(ClientBatch(clients, groups, 2, r))
        want = _alone(sched, own, 11, 2, groups, r, clients)
        for i, (batches, wsz) in enumerate(want):
            assert st_[i] == len(wsz) and sz[i, : len(wsz)].tolist() == wsz
            assert [gidx[i, s, : wsz[s]].tolist() for s in range(len(wsz))] == batches
    assert not plans._ahead  # every round planned ahead was taken


def test_other_clients_are_planned_now_and_clear_forgets():
    sched = LocalSchedule(batch_size=3)
    own = [np.arange(0, 7), np.arange(7, 12), np.arange(12, 20)]
    plans = BatchPlans(sched, 0, own)
    plans.expect([0, 1], [0, 0], 1, 4)
    ref = BatchPlans(sched, 0, own)
    other = ClientBatch([1, 2], [0, 0], 1, 0)  # not the expected chunk: its own plan, nothing kept
    assert all((a == b).all() for a, b in zip(plans(other), ref(other)))
    assert not plans._ahead
    plans(ClientBatch([0, 1], [0, 0], 1, 0))
    assert sorted(k[-1] for k in plans._ahead) == [1, 2, 3]
    plans.clear()
    assert not plans._ahead and not plans._until


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 25), min_size=3, max_size=7),
    b=st.integers(1, 6),
    steps=st.one_of(st.none(), st.integers(1, 5)),
    requests=st.lists(
        st.tuples(st.integers(1, 5), st.integers(0, 7), st.integers(0, 4), st.integers(0, 3)),
        min_size=1,
        max_size=5,
    ),
)
def test_stages_prepared_together_equal_each_planned_alone(sizes, b, steps, requests):
    """Requests of other clients, stages and step counts in one call: each one's plans as alone, same shapes."""
    sched = LocalSchedule(batch_size=b, local_steps=steps)
    rng = np.random.default_rng(len(sizes))
    own = np.split(rng.permutation(sum(sizes)), np.cumsum(sizes)[:-1])
    reqs = []
    for j, (stage, first, n_rounds, drop) in enumerate(requests):
        stage = 5 * j + stage  # one request per stage, as in a replay (stage <= 5: no two collide)
        clients = [c for c in range(len(sizes)) if (c + stage) % (drop + 1) == 0] or [stage % len(sizes)]
        reqs.append((clients, [stage + c % 2 for c in clients], stage, range(first, first + n_rounds + 1)))
    plans = BatchPlans(sched, 5, own)
    assert plans.prepare(reqs)
    for clients, groups, stage, rounds in reqs:
        got = plans.plan(clients, groups, stage, rounds)
        want = BatchPlans(sched, 5, own).plan(clients, groups, stage, rounds)
        for (g, s, n), (wg, ws, wn) in zip(got, want, strict=True):
            assert g.shape == wg.shape and (g == wg).all() and (s == ws).all() and (n == wn).all()
        for r in rounds:  # a single-client schedule agrees as well
            for i, (batches, wsz) in enumerate(_alone(sched, own, 5, stage, groups, r, clients)):
                assert got[r - rounds[0]][2][i] == len(wsz)
                assert [got[r - rounds[0]][0][i, s_, : wsz[s_]].tolist() for s_ in range(len(wsz))] == batches
    assert not plans._ahead  # every prepared round was taken


def test_prepare_over_the_budget_keeps_nothing():
    sched = LocalSchedule(batch_size=3)
    own = [np.arange(0, 7), np.arange(7, 12)]
    plans = BatchPlans(sched, 0, own, budget=5)
    assert not plans.prepare([([0, 1], [0, 0], 1, range(2))])
    assert not plans._ahead
