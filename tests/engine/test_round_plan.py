"""A round's participant plan, built once per call, against a plain per-round computation."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine.aggregate import GroupSums
from fedshard_lightning.engine.round_plan import RoundPlan


@settings(max_examples=30, deadline=None)
@given(
    parts=st.lists(st.lists(st.integers(0, 19), max_size=6, unique=True), min_size=1, max_size=5),
    chunk=st.integers(1, 9),
    seed=st.integers(0, 1000),
)
def test_round_plan_equals_a_plain_loop(parts, chunk, seed):
    sizes = np.random.default_rng(seed).integers(0, 40, 20)
    n_groups = len(parts) + 2  # two groups inactive this round
    active = sorted(np.random.default_rng(seed).choice(n_groups, len(parts), replace=False).tolist())
    plan = RoundPlan.build(active, parts, n_groups, sizes, chunk, torch.float32, torch.device("cpu"))
    flat = [(c, g) for g, p in zip(active, parts) for c in p]
    assert plan.clients == [c for c, _ in flat]
    weight = [0.0] * n_groups
    counts = [0] * n_groups
    for c, g in flat:
        weight[g] += float(sizes[c])
        counts[g] += 1
    assert plan.weight.tolist() == weight and plan.weight.dtype == torch.float64
    assert plan.counts == counts
    assert plan.active_t.tolist() == active
    assert plan.metric_norm == max(float(sum(sizes[c] for c, _ in flat)), 1.0)
    chunks = [flat[lo : lo + chunk] for lo in range(0, len(flat), chunk)]
    assert len(plan.chunks) == len(chunks)
    for ch, want in zip(plan.chunks, chunks):
        assert ch.clients == [c for c, _ in want] and ch.owners == [g for _, g in want]
        assert ch.owners_t.tolist() == ch.owners and ch.owners_cpu.tolist() == ch.owners
        assert ch.samples.dtype == torch.float32 and ch.samples.tolist() == [float(sizes[c]) for c, _ in want]
        assert ch.samples_f64.tolist() == [float(sizes[c]) for c, _ in want]


def test_group_sums_reusing_block_plans_equal_fresh_ones_and_per_tensor_sums():
    """The same chunk layout in two rounds: the second reuses the first's plan; both equal fresh sums."""
    gen = torch.Generator().manual_seed(0)
    like = {"w": torch.zeros(3, 4, 2), "b": torch.zeros(3, 4), "r": torch.zeros(3, 5, dtype=torch.float64)}
    owners = [0, 0, 2, 2, 2, 0]
    counts = [3, 0, 3]
    plans: dict = {}
    for _ in range(2):
        rows = {
            k: torch.randn(len(owners), *v.shape[1:], generator=gen, dtype=v.dtype) for k, v in like.items()
        }
        w = torch.randint(1, 50, (len(owners),), generator=gen).float()
        shared, fresh = GroupSums(like, counts, plans), GroupSums(like, counts)
        for s in (shared, fresh):
            s.add({k: v[:4] for k, v in rows.items()}, w[:4], owners[:4])
            s.add({k: v[4:] for k, v in rows.items()}, w[4:], owners[4:])
        for k, v in like.items():  # one tensor at a time, the pairwise rule written out
            for g in range(3):
                idx = [i for i, o in enumerate(owners) if o == g]
                x = [rows[k][i] * w[i].to(v.dtype) for i in idx]
                want = torch.zeros(v.shape[1:], dtype=v.dtype) if not x else (x[0] + x[1]) + x[2]
                assert torch.equal(shared.totals()[k][g], want) and torch.equal(fresh.totals()[k][g], want)
        avg = shared.averages(torch.tensor([0, 2]), torch.tensor([5.0, 7.0], dtype=torch.float64))
        for k in like:
            assert torch.equal(avg[k][1], shared.totals()[k][2] / torch.tensor(7.0, dtype=like[k].dtype))
    assert len(plans) == 2  # one plan per distinct chunk layout, reused in the second round


@settings(max_examples=30, deadline=None)
@given(
    parts=st.lists(st.lists(st.integers(0, 150), max_size=70, unique=True), min_size=1, max_size=3),
    chunk=st.integers(1, 80),
    seed=st.integers(0, 1000),
)
def test_plan_meta_and_write_averages_equal_the_sums_built_row_by_row(parts, chunk, seed):
    """A plan's per-chunk (group, block, slot) and the in-place averages give the bits of the plain path."""
    sizes = np.random.default_rng(seed).integers(1, 40, 151)
    n_groups = len(parts) + 1
    active = list(range(len(parts)))
    plan = RoundPlan.build(active, parts, n_groups, sizes, chunk, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    like = {"w": torch.zeros(n_groups, 3, 2), "r": torch.zeros(n_groups, 4, dtype=torch.float64)}
    with_meta, plain = GroupSums(like, plan.counts), GroupSums(like, plan.counts)
    for ch in plan.chunks:
        rows = {
            k: torch.randn(len(ch.clients), *v.shape[1:], generator=gen, dtype=v.dtype)
            for k, v in like.items()
        }
        with_meta.add(rows, ch.samples, ch.owners, ch.meta)
        plain.add(rows, ch.samples, ch.owners)
    state = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in like.items()}
    want = {k: v.clone() for k, v in state.items()}
    with_meta.write_averages(state, plan.active_t, plan.active_weight)
    for k, v in plain.averages(plan.active_t, plan.weight[plan.active_t]).items():
        want[k][plan.active_t] = v
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}  # NaN (0 / 0 of an empty group) too
    for k, v in like.items():  # the untouched row (an inactive group) included
        assert torch.equal(state[k].view(bits[v.dtype]), want[k].view(bits[v.dtype]))
