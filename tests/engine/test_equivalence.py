"""The vectorized engine against the per-client loop (the reference), SPEC section 3."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _models import LBFGSMLP, ExplodingMLP, PlateauMLP

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.errors import ConfigError, ContractError, NonFiniteLossError
from fedshard_lightning.models import MLP, FedAvgCNN


def _data(k=12, n=300, shape=(10,), partition="dirichlet", **kw):
    dm = SyntheticDataModule(
        num_clients=k,
        partition=partition,
        rho=0.5,
        min_client_size=5,
        num_samples=n,
        num_test=50,
        shape=shape,
        num_classes_=4,
        **kw,
    )
    dm.setup()
    return dm


def _model(dm, cls=MLP, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    kw.setdefault("hidden", (16,)) if cls is MLP else None
    m = cls(**kw)
    m.bind_data(dm.input_shape, dm.num_classes)
    return m.to(dtype)


def _train(m, dm, mode, schedule, fraction=1.0, groups=None, chunk=None, rounds=3, seed=1):
    eng = FederatedEngine(
        m, dm, schedule, seed=seed, client_fraction=fraction, vectorize=mode, max_chunk_clients=chunk
    )
    k = len(dm.client_indices)
    groups = groups or [
        Group(0, tuple(range(0, k // 2)), rounds),
        Group(1, tuple(range(k // 2, k)), rounds - 1),
    ]
    init = stack_params([eng.module_params()] * len(groups))
    return eng.train_groups(init, groups, stage=1)


def _maxdiff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


OPTIMIZERS = [
    dict(optimizer="sgd", lr=0.1),
    dict(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3),
    dict(optimizer="adam", lr=0.01, weight_decay=1e-4),
    dict(optimizer="adamw", lr=0.01, weight_decay=1e-2),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o['optimizer']}-m{o.get('momentum', 0)}")
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_stacked_equals_loop_float64(opt, fraction):
    dm = _data()
    sizes = dm.client_sizes
    assert len(set(sizes)) > 3, "clients must have unequal sizes"
    assert any(s % 7 for s in sizes), "some clients must end epochs on a partial batch"
    m = _model(dm, **opt)
    sched = LocalSchedule(batch_size=7, local_epochs=2)
    a = _train(m, dm, "always", sched, fraction)
    b = _train(m, dm, "never", sched, fraction)
    assert a.client_steps == b.client_steps > 0
    assert a.rounds_run == b.rounds_run == [3, 2]
    assert _maxdiff(a.params, b.params) <= 1e-10
    assert _maxdiff(a.params, stack_params([m.state_dict()] * 2)) > 1e-3  # it trained


def test_stacked_equals_loop_local_steps_and_cnn_float32():
    dm = _data(k=6, n=120, shape=(1, 8, 8))
    m = _model(dm, FedAvgCNN, dtype=torch.float32, channels=(4, 8), hidden=16, lr=0.05, momentum=0.5)
    sched = LocalSchedule(batch_size=5, local_steps=4)
    a = _train(m, dm, "always", sched, rounds=2)
    b = _train(m, dm, "never", sched, rounds=2)
    assert a.client_steps == b.client_steps == 6 * 4 + 3 * 4
    assert _maxdiff(a.params, b.params) <= 1e-5  # float32 tolerance: summation order of batched kernels


def test_client_independent_of_batch_mates():
    dm = _data(k=8)
    m = _model(dm, optimizer="adam", lr=0.01)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=4, local_epochs=2), seed=5, vectorize="always")
    p0 = eng.module_params()
    alone = eng.local.train_stacked(stack_params([p0]), ClientBatch([3], [0], 1, 0)).params
    crowd = eng.local.train_stacked(
        stack_params([p0] * 8), ClientBatch([0, 1, 2, 3, 4, 5, 6, 7], [0] * 8, 1, 0)
    )
    assert max(float((alone[k][0] - crowd.params[k][3]).abs().max()) for k in alone) <= 1e-12


def test_chunking_does_not_change_result():
    dm = _data()
    m = _model(dm, optimizer="sgd", lr=0.1, momentum=0.9)
    sched = LocalSchedule(batch_size=6, local_epochs=1)
    a = _train(m, dm, "always", sched)
    b = _train(m, dm, "always", sched, chunk=3)
    assert _maxdiff(a.params, b.params) <= 1e-12


def test_keyed_randomness_and_sampling_reproducible():
    dm = _data()
    m = _model(dm)
    sched = LocalSchedule(batch_size=5)
    a = _train(m, dm, "always", sched, fraction=0.5, seed=3)
    b = _train(m, dm, "always", sched, fraction=0.5, seed=3)
    c = _train(m, dm, "always", sched, fraction=0.5, seed=4)
    assert _maxdiff(a.params, b.params) == 0.0
    assert _maxdiff(a.params, c.params) > 0
    assert [h.participants for h in a.history] == [h.participants for h in b.history]
    assert all(len(p) == 3 for h in a.history for p in h.participants)  # ceil(0.5 * 6)


def test_schedule_visits_every_sample_once_per_epoch():
    sched = LocalSchedule(batch_size=4, local_epochs=3)
    idx, sizes = sched.batches(10, seed=0, stage=1, group=2, round_=3, client=4)
    assert list(sizes) == [4, 4, 2] * 3
    for e in range(3):
        seen = np.concatenate([idx[e * 3 + s, : sizes[e * 3 + s]] for s in range(3)])
        assert sorted(seen.tolist()) == list(range(10))
    idx2, _ = sched.batches(10, seed=0, stage=1, group=2, round_=3, client=4)
    assert (idx == idx2).all()
    other, _ = sched.batches(10, seed=0, stage=1, group=2, round_=4, client=4)
    assert not (idx == other).all()


@pytest.mark.parametrize(
    ("cls", "pattern"),
    [(LBFGSMLP, "element-wise"), (PlateauMLP, "ReduceLROnPlateau")],
)
def test_contract_errors(cls, pattern):
    dm = _data(k=4, n=80)
    m = _model(dm, cls)
    with pytest.raises(ContractError, match=pattern):
        _train(m, dm, "always", LocalSchedule(batch_size=5), rounds=2)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_non_finite_loss_names_stage_shard_round_client(mode):
    dm = _data(k=4, n=80)
    m = _model(dm, ExplodingMLP)
    with pytest.raises(NonFiniteLossError, match=r"stage 1, shard \d+, round 0, client \d+"):
        _train(m, dm, mode, LocalSchedule(batch_size=5), rounds=2)


def test_auto_mode_picks_a_mode():
    dm = _data(k=4, n=80)
    m = _model(dm)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), vectorize="auto")
    eng.train_groups(stack_params([eng.module_params()]), [Group(0, (0, 1, 2, 3), 1)])
    assert eng.mode in ("stacked", "loop")


def test_with_optimizer_replaces_the_client_optimizer_on_both_paths():
    from fedshard_lightning.engine.optim import OptimizerSpec

    dm = _data(k=6, n=120)
    m = _model(dm, optimizer="sgd", lr=0.1)
    spec = OptimizerSpec(torch.optim.Adam, ((tuple(n for n, _ in m.named_parameters()), {"lr": 0.01}),))
    res = {}
    for mode in ("always", "never"):
        eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize=mode).with_optimizer(spec)
        init = stack_params([eng.module_params()])
        res[mode] = eng.train_groups(init, [Group(0, tuple(range(6)), 2)]).params
    plain = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize="always")
    sgd = plain.train_groups(stack_params([plain.module_params()]), [Group(0, tuple(range(6)), 2)]).params
    assert _maxdiff(res["always"], res["never"]) <= 1e-10
    assert _maxdiff(res["always"], sgd) > 1e-6


def test_with_optimizer_and_with_participants_return_new_engines():
    from fedshard_lightning.engine.optim import OptimizerSpec

    dm = _data(k=6, n=120)
    m = _model(dm, optimizer="sgd", lr=0.1)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize="always")
    spec = OptimizerSpec(torch.optim.Adam, ((tuple(n for n, _ in m.named_parameters()), {"lr": 0.01}),))
    other = eng.with_optimizer(spec)
    assert other is not eng and other.spec is spec and eng.spec is not spec
    assert eng.local.spec is not spec and not eng.local.loop_uses_spec

    def evens(stage, group, round_):
        return [c for c in group.clients if c % 2 == 0]

    picky = eng.with_participants(evens)
    assert eng.samples_everyone and not picky.samples_everyone
    res = picky.train_groups(stack_params([eng.module_params()]), [Group(0, tuple(range(6)), 1)])
    assert res.history[0].participants == [[0, 2, 4]]
    with pytest.raises(ConfigError, match="participants policy"):
        eng.with_participants(42)
