"""The vectorized keyed schedule: permutations per epoch, and no dependence on batch mates."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine.keys import client_keys, counter_bits, keyed_uniform_bits, mix64
from fedshard_lightning.engine.schedule import LocalSchedule


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    b=st.integers(1, 9),
    epochs=st.integers(1, 3),
    steps=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 2**31 - 1),
)
def test_plan_is_per_client_and_visits_each_sample_once_per_epoch(sizes, b, epochs, steps, seed):
    sched = LocalSchedule(batch_size=b, local_epochs=epochs, local_steps=steps)
    n = np.array(sizes)
    clients = np.arange(len(sizes)) * 7 + 3
    groups = np.arange(len(sizes)) % 2
    pos, sz, n_steps = sched.plan(n, seed, 2, groups, 5, clients)
    for i, ni in enumerate(sizes):
        assert n_steps[i] == sched.num_steps(ni)
        alone_pos, alone_sz = sched.batches(ni, seed, 2, int(groups[i]), 5, int(clients[i]))
        assert (pos[i, : n_steps[i]] == alone_pos).all() and (sz[i, : n_steps[i]] == alone_sz).all()
        assert (sz[i, n_steps[i] :] == 0).all()
        flat = np.concatenate([alone_pos[s, : alone_sz[s]] for s in range(len(alone_sz))])
        per_epoch = -(-ni // b)
        for e in range(0, len(alone_sz), per_epoch):
            seen = np.concatenate(
                [alone_pos[s, : alone_sz[s]] for s in range(e, min(e + per_epoch, len(alone_sz)))]
            )
            assert len(set(seen.tolist())) == len(seen)  # no sample twice within an epoch
            if e + per_epoch <= len(alone_sz):
                assert sorted(seen.tolist()) == list(range(ni))
        assert flat.max() < ni


def test_keyed_bits_depend_on_every_key_field():
    base = dict(
        seed=1, stage=2, groups=np.array([3]), round_=4, clients=np.array([5]), counters=np.array([6])
    )
    ref = keyed_uniform_bits(**base)
    for field, other in [
        ("seed", 9),
        ("stage", 9),
        ("groups", np.array([9])),
        ("round_", 9),
        ("clients", np.array([9])),
        ("counters", np.array([9])),
    ]:
        assert keyed_uniform_bits(**{**base, field: other}) != ref
    assert (keyed_uniform_bits(**base) == ref).all()


def test_mix64_is_a_bijection_on_a_sample():
    z = np.arange(100_000, dtype=np.uint64)
    assert len(np.unique(mix64(z))) == len(z)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    b=st.integers(1, 9),
    epochs=st.integers(1, 3),
    steps=st.one_of(st.none(), st.integers(1, 12)),
)
def test_plan_batch_sizes_equal_a_plain_loop_over_epochs(sizes, b, epochs, steps):
    """Batch sizes (computed by formula, not by counting the plan's draws) against a plain loop."""
    sched = LocalSchedule(batch_size=b, local_epochs=epochs, local_steps=steps)
    n = np.array(sizes)
    pos, sz, n_steps = sched.plan(n, 0, 1, np.zeros(len(sizes), dtype=np.int64), 0, np.arange(len(sizes)))
    for i, ni in enumerate(sizes):
        want: list[int] = []
        while ni and len(want) < (steps if steps is not None else epochs * -(-ni // b)):
            want += [min(b, ni - lo) for lo in range(0, ni, b)]  # one epoch's batches
        want = want[: steps if steps is not None else len(want)]
        assert sz[i].tolist() == want + [0] * (sz.shape[1] - len(want)), (i, ni)
        assert n_steps[i] == len(want)
        # every real slot of a batch holds a sample of the client; padding stays 0
        for s, k in enumerate(want):
            assert (pos[i, s, k:] == 0).all() and (pos[i, s, :k] < ni).all()


def test_client_keys_then_counters_equal_the_per_draw_hash():
    """The per-client key hash, broadcast to the draws, against the hash chain written out per draw."""
    rng = np.random.default_rng(0)
    groups, clients = rng.integers(0, 50, 9), rng.integers(0, 5000, 9)
    owner = np.repeat(np.arange(9), rng.integers(0, 30, 9))
    counters = rng.integers(0, 1000, len(owner))
    u = lambda v: np.asarray(v, dtype=np.int64).astype(np.uint64)  # noqa: E731
    with np.errstate(over="ignore"):
        k = mix64(u(7))
        for field in (u(3), u(groups[owner]), u(11), u(clients[owner] + 1)):
            k = mix64(k ^ field)
        want = mix64(k ^ mix64(u(counters)))
    got = counter_bits(client_keys(7, 3, groups, 11, clients)[owner], counters)
    assert got.dtype == np.uint64 and (got == want).all()
    assert (keyed_uniform_bits(7, 3, groups[owner], 11, clients[owner], counters) == want).all()


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.one_of(
        st.lists(st.integers(0, 30), min_size=1, max_size=10),  # similar sizes: the padded sort
        st.lists(st.integers(0, 3), min_size=8, max_size=12).map(lambda s: [*s, 250]),  # one giant: lexsort
    ),
    b=st.integers(1, 7),
    epochs=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_plan_order_equals_sorting_each_epoch_by_its_keyed_bits(sizes, b, epochs, seed):
    """The SPEC's shuffle written out: epoch e of a client visits ranks sorted by the bits of e*n + rank."""
    sched = LocalSchedule(batch_size=b, local_epochs=epochs)
    clients = np.arange(len(sizes)) * 5 + 1
    groups = np.arange(len(sizes)) % 3
    pos, sz, n_steps = sched.plan(np.array(sizes), seed, 1, groups, 4, clients)
    for i, n in enumerate(sizes):
        key = client_keys(seed, 1, groups[i : i + 1], 4, clients[i : i + 1])
        visited = [int(p) for s in range(n_steps[i]) for p in pos[i, s, : sz[i, s]]]
        want = []
        for e in range(epochs):
            bits = counter_bits(key, np.arange(e * n, (e + 1) * n)).tolist()
            want += sorted(range(n), key=lambda r: (bits[r], r))
        assert visited == want
