"""The engine's lean path (watched and unwatched rounds) against its general path: every result, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
from _tiny import tiny_data
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine import lean_frames as frames_module
from fedshard_lightning.engine import lean_rounds as lean_module
from fedshard_lightning.engine.lean_rounds import lean_eligible
from fedshard_lightning.errors import NonFiniteLossError
from fedshard_lightning.models import MLP


def _engine(k=10, dtype=torch.float32, seed=0, batch=4, lr=0.1, fraction=1.0, vectorize="always", **kw):
    dm = tiny_data(shape=(6,), k=k, per_client=16, classes=3, min_client_size=3, seed=seed)
    dm.setup()
    torch.manual_seed(seed)
    m = MLP(hidden=(8, 5), lr=lr, **kw)
    m.bind_data(dm.input_shape, dm.num_classes)
    return FederatedEngine(
        m.to(dtype),
        dm,
        LocalSchedule(batch_size=batch),
        seed=seed,
        client_fraction=fraction,
        vectorize=vectorize,
    )


def _general(eng, *args, **kw):
    """``train_groups`` on the general path."""
    eng.lean_rounds = False
    try:
        return eng.train_groups(*args, **kw)
    finally:
        eng.lean_rounds = True


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


def _same(a, b):
    assert a.params.keys() == b.params.keys()
    for k in a.params:
        assert a.params[k].shape == b.params[k].shape and torch.equal(
            _bits(a.params[k]), _bits(b.params[k])
        ), k
    assert a.client_steps == b.client_steps and a.group_client_steps == b.group_client_steps
    assert a.rounds_run == b.rounds_run and len(a.history) == len(b.history)
    for x, y in zip(a.history, b.history):
        assert (x.stage, x.round, x.active, x.participants) == (y.stage, y.round, y.active, y.participants)
        assert (x.client_steps, x.client_ids, x.metrics) == (y.client_steps, y.client_ids, y.metrics)
        assert x.mean_loss == y.mean_loss  # the same float64 sums, in the same order


@settings(max_examples=25, deadline=None)
@given(
    split=st.lists(st.integers(0, 3), min_size=10, max_size=10),
    rounds=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 50),
    batch=st.integers(2, 9),
    one_pass=st.booleans(),
)
@pytest.mark.exactness
def test_lean_rounds_equal_the_general_path(split, rounds, dtype, seed, batch, one_pass):
    """Groups of unequal sizes and rounds (segments), clients with unequal steps, empty groups.

    ``one_pass``: the leaves are weighted tensor by tensor into the sums' matrix (large models).
    """
    saved = lean_module._ONE_PASS
    lean_module._ONE_PASS = 0 if one_pass else saved
    try:
        _check_lean_equals_general(split, rounds, dtype, seed, batch)
    finally:
        lean_module._ONE_PASS = saved


def _check_lean_equals_general(split, rounds, dtype, seed, batch):
    eng = _engine(dtype=dtype, seed=seed, batch=batch)
    groups = [Group(g, tuple(c for c, s in enumerate(split) if s == g), rounds[g]) for g in range(4)]
    assert lean_eligible(eng, groups)
    init = stack_params([eng.module_params()] * len(groups))
    init = {
        k: v + 0.01 * torch.arange(len(groups), dtype=v.dtype).view(-1, *[1] * (v.ndim - 1))
        for k, v in init.items()
    }
    lean = eng.train_groups(init, groups, stage=2)
    general = _general(eng, init, groups, stage=2)
    _same(lean, general)
    assert all(v.is_contiguous() for v in lean.params.values())


@settings(max_examples=20, deadline=None)
@given(
    split=st.lists(st.integers(0, 2), min_size=10, max_size=10),
    rounds=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    stops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), max_size=3),
    seed=st.integers(0, 50),
)
def test_watched_lean_rounds_equal_the_general_path(split, rounds, stops, seed):
    """A hook sees the same records and models each round, and stops the same groups early."""
    eng = _engine(seed=seed)
    groups = [Group(g, tuple(c for c, s in enumerate(split) if s == g), rounds[g]) for g in range(3)]
    init = stack_params([eng.module_params()] * len(groups))
    seen = {True: [], False: []}

    def hook_for(lean):
        def hook(info, state):
            seen[lean].append(
                (info.round, info.active, info.mean_loss, {k: v.clone() for k, v in state.items()})
            )
            return [any(r == info.round and g == i for r, g in stops) for i in range(len(groups))]

        return hook

    lean = eng.train_groups(init, groups, stage=1, on_round_end=hook_for(True))
    general = _general(eng, init, groups, stage=1, on_round_end=hook_for(False))
    _same(lean, general)
    assert len(seen[True]) == len(seen[False])
    for (r, a, loss, st_), (r2, a2, loss2, st2) in zip(seen[True], seen[False]):
        assert (r, a, loss) == (r2, a2, loss2)
        assert all(torch.equal(_bits(st_[k]), _bits(st2[k])) for k in st_)


def test_lean_path_is_taken_only_where_it_applies():
    eng = _engine()
    groups = [Group(0, tuple(range(10)), 2)]
    assert lean_eligible(eng, groups)
    eng.chunk = 4  # several chunks a round
    assert not lean_eligible(eng, groups)
    assert not lean_eligible(_engine(momentum=0.9), groups)  # no fused SGD
    assert not lean_eligible(_engine(fraction=0.5), groups)  # participants vary by round
    assert not lean_eligible(_engine(vectorize="never"), groups)  # the per-client loop
    assert not lean_eligible(_engine(vectorize="auto"), groups)  # not yet probed: the general path probes


def test_lean_path_reports_a_non_finite_loss_like_the_general_path():
    groups = [Group(0, tuple(range(5)), 3), Group(1, tuple(range(5, 10)), 3)]
    errors = []
    for lean, hook in ((True, None), (True, lambda info, state: None), (False, None)):
        eng = _engine(lr=1e30)
        eng.lean_rounds = lean
        init = stack_params([eng.module_params()] * 2)
        with pytest.raises(NonFiniteLossError) as err:
            eng.train_groups(init, groups, stage=1, on_round_end=hook)
        errors.append(str(err.value))
    assert errors[0] == errors[1] == errors[2] and "stage 1" in errors[0]


def test_lean_path_equals_the_per_client_loop():
    """An independent reference: the per-client loop with the user's optimizer and backward."""
    groups = [Group(0, tuple(range(4)), 3), Group(1, tuple(range(4, 10)), 2)]
    out = []
    for mode in ("always", "never"):
        eng = _engine(dtype=torch.float64, vectorize=mode)
        assert lean_eligible(eng, groups) == (mode == "always")
        out.append(eng.train_groups(stack_params([eng.module_params()] * 2), groups, stage=1))
    for k in out[0].params:
        torch.testing.assert_close(out[0].params[k], out[1].params[k], rtol=1e-10, atol=1e-12)
    assert out[0].client_steps == out[1].client_steps


def test_auto_decides_on_the_chunk_the_general_path_would_time(monkeypatch):
    """``vectorize: auto``: the probe sees round 0's first chunk on both paths; the results are equal."""
    from fedshard_lightning.engine import engine as engine_module

    seen = []

    def record(local, start, batch, *_):
        seen.append(({k: v.clone() for k, v in start.items()}, batch))
        return "stacked", "recorded"

    monkeypatch.setattr(engine_module, "choose_path", record)
    groups = [Group(0, (), 2), Group(1, tuple(range(3, 9)), 2), Group(2, (0, 1, 2), 1)]
    out = []
    for lean in (True, False):
        eng = _engine(vectorize="auto")
        eng.lean_rounds = lean
        init = stack_params([eng.module_params()] * 3)
        init = {
            k: v + 0.01 * torch.arange(3, dtype=v.dtype).view(-1, *[1] * (v.ndim - 1))
            for k, v in init.items()
        }
        out.append(eng.train_groups(init, groups, stage=1))
        assert eng.mode == "stacked"
    (a, batch_a), (b, batch_b) = seen
    assert batch_a == batch_b and batch_a.clients == [3, 4, 5, 6, 7, 8, 0, 1, 2] and batch_a.round == 0
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _same(out[0], out[1])


def test_kept_frames_serve_later_calls_of_other_clients():
    """A frame (buffers and views by shape) made for one call serves a later call of other clients alike."""
    eng = _engine(k=12)
    init = stack_params([eng.module_params()] * 2)
    calls = [
        [Group(0, (0, 1, 2), 3), Group(1, (3, 4), 3)],
        [Group(0, (5, 6, 7), 3), Group(1, (8, 9), 3)],  # other clients, the same shapes
        [Group(0, (0, 1, 2), 3), Group(1, (3, 4), 3)],
    ]
    made = []
    for groups in calls:
        _same(eng.train_groups(init, groups, stage=1), _general(eng, init, groups, stage=1))
        made.append({id(f) for f in eng.lean_frames.values()})
    assert made[0] and made[0] <= made[2] and len(made[2]) <= 2  # the third call took the first one's frame


def test_frames_are_kept_within_their_budget(monkeypatch):
    """Least recently used frames go first; a frame larger than the budget serves its call and is dropped."""
    eng = _engine(k=12)
    init = stack_params([eng.module_params()])
    monkeypatch.setattr(frames_module, "_FRAMES", 2)
    for n in (4, 3, 2):  # three shapes, two kept: the last two
        groups = [Group(0, tuple(range(n)), 2)]
        _same(eng.train_groups(init, groups, stage=1), _general(eng, init, groups, stage=1))
    assert sorted(key[0] for key in eng.lean_frames) == [2, 3]
    monkeypatch.setattr(frames_module, "_FRAMES_BYTES", 1)
    groups = [Group(0, tuple(range(5)), 2)]
    _same(eng.train_groups(init, groups, stage=1), _general(eng, init, groups, stage=1))
    assert not eng.lean_frames


def test_frames_share_memory_and_keep_their_results():
    """Frames of other shapes overlap in the engine's blocks; a frame taken again after another wrote there still gives the general path's bits."""
    eng = _engine(k=12)
    init = stack_params([eng.module_params()])
    kept = []
    for n in (3, 5, 3, 5):
        groups = [Group(0, tuple(range(n)), 2)]
        _same(eng.train_groups(init, groups, stage=1), _general(eng, init, groups, stage=1))
        kept.append(sorted(key[0] for key in eng.lean_frames))
    # The block grew for 5 clients, so the frame of 3 was dropped, then made again in the new block.
    assert kept == [[3], [5], [3, 5], [3, 5]]
    starts = {next(iter(f.leaves.values())).data_ptr() for f in eng.lean_frames.values()}
    (block,) = [b for (dt, _), b in eng.lean_arena.items() if dt == torch.float32]
    assert starts == {block.data_ptr()}  # both laid out from the start of the same block


def test_a_frame_over_the_budget_gets_memory_of_its_own(monkeypatch):
    """Memory is not kept for a frame that is not kept."""
    eng = _engine(k=12)
    init = stack_params([eng.module_params()])
    monkeypatch.setattr(frames_module, "_FRAMES_BYTES", 1)
    groups = [Group(0, (0, 1, 2), 2)]
    _same(eng.train_groups(init, groups, stage=1), _general(eng, init, groups, stage=1))
    assert not eng.lean_frames and not eng.lean_arena


def test_one_engine_through_many_shapes_keeps_its_frames_in_one_block(monkeypatch):
    """Calls of random shapes in a row (the block grows, frames are dropped and made again): each gives the general path's bits, and every kept frame lies in the current block."""
    eng = _engine(k=12)
    rng = random.Random(0)
    monkeypatch.setattr(frames_module, "_FRAMES", 4)
    for _ in range(30):
        n_groups = rng.randint(1, 3)
        clients = rng.sample(range(12), rng.randint(n_groups, 12))
        cuts = sorted(rng.sample(range(1, len(clients)), n_groups - 1))
        parts = [clients[a:b] for a, b in zip([0, *cuts], [*cuts, len(clients)])]
        groups = [Group(i, tuple(p), rng.randint(1, 3)) for i, p in enumerate(parts)]
        init = stack_params([eng.module_params()] * n_groups)
        stage = rng.randint(1, 3)
        _same(eng.train_groups(init, groups, stage=stage), _general(eng, init, groups, stage=stage))
        blocks = {dt: b for (dt, _), b in eng.lean_arena.items()}
        for frame in eng.lean_frames.values():
            for t in frame.leaves.values():
                b = blocks[t.dtype]
                assert b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
