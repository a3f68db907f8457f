"""A BatchNorm model under every unlearning method, and FedBN (client-local BatchNorm layers).

References: an independent retraining (the audit, tolerance 0 in float32) for the exact methods;
a numpy weighted average for FedAvg's aggregation of the BN buffers; the closed form of
BatchNorm's exponential running average for what FedBN keeps local.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _models import BNDropoutCNN

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.local_layers import local_layer_names
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.flcache import load_tensors
from fedshard_lightning.models import MLP
from fedshard_lightning.module import bind_model
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FATS, FedAvg, FedEraser, FedRecover, FedShard, RapidRetrain
from fedshard_lightning.unlearning.base import Algorithm

SHAPE = (1, 8, 8)


def _data(k: int = 6) -> SyntheticDataModule:
    return SyntheticDataModule(
        num_clients=k,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=k * 16,
        num_test=30,
        shape=SHAPE,
        num_classes_=3,
        as_uint8=True,
    )


def _model() -> BNDropoutCNN:
    torch.manual_seed(0)
    return BNDropoutCNN(lr=0.1)


def _trainer(root, algorithm: Algorithm) -> FederatedTrainer:
    return FederatedTrainer(
        algorithm=algorithm,
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
    )


METHODS = {
    "fedshard": lambda **kw: FedShard(rounds="fixed", fixed_rounds=2, batch_size=5, **kw),
    "fedavg": lambda **kw: FedAvg(rounds=2, batch_size=5, **kw),
    "fats": lambda **kw: FATS(rounds=3, sample_size=3, batch_size=5, **kw),
    "federaser": lambda **kw: FedEraser(rounds=3, delta_t=1, calibration_ratio=1.0, batch_size=5, **kw),
    "rapid_retrain": lambda **kw: RapidRetrain(rounds=2, unlearn_rounds=1, batch_size=5, **kw),
    "fedrecover": lambda **kw: FedRecover(
        rounds=3, warmup_rounds=1, correction_period=2, final_tuning_rounds=1, batch_size=5, **kw
    ),
}


def _fit_unlearn(root, make):
    tr = _trainer(root, make())
    tr.fit(_model(), _data())
    run = tr.run_dir
    alg = tr.algorithm
    # A client that trained (FATS samples clients; an unsampled one costs nothing to unlearn).
    client = next(c for c in range(6) if not isinstance(alg, FATS) or alg.first_round([c]) is not None)
    report = _trainer(root, make()).unlearn(_model(), _data(), str(run), [client])
    return tr, run, report


@pytest.mark.parametrize("method", sorted(METHODS))
def test_batchnorm_model_fits_and_unlearns_with_every_method(tmp_path, method):
    make = METHODS[method]
    tr, run, report = _fit_unlearn(tmp_path, make)
    assert tr.algorithm.engine.buffer_names, "the BN statistics travel with the model"
    assert report["client_steps"] > 0 and np.isfinite(report["test_accuracy_after"])
    unlearned = load_tensors(run / "model.safetensors")
    for k in tr.algorithm.engine.buffer_names:  # the unlearned model's statistics are usable
        assert torch.isfinite(unlearned[k]).all() and (k.endswith("mean") or bool((unlearned[k] > 0).all()))
    if method == "fedrecover":
        assert report["estimated_rounds"], "the L-BFGS estimate ran on a BN model"
    if make().exact:
        res = _trainer(tmp_path, make()).audit(_model(), _data(), str(run), tolerance=0.0)
        assert res["passed"] and res["max_abs_diff"] == 0.0


# -- FedBN ---------------------------------------------------------------------------------------
def _engine(local_bn: str):
    dm = _data()
    dm.setup()
    m = _model()
    bind_model(m, dm.input_shape, dm.num_classes)
    m = m.double()
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=7, local_epochs=2), seed=1, vectorize="always")
    eng.local_names = local_layer_names(m, local_bn, eng.names)
    return eng


def _two_rounds(eng):
    groups = [Group(0, (0, 1, 2), 2), Group(1, (3, 4, 5), 2)]
    init = stack_params([eng.module_params()] * 2)
    return groups, eng.train_groups(init, groups, stage=1, keep_client_params=True)


def test_off_averages_bn_buffers_with_fedavg_weights_numpy_reference():
    eng = _engine("off")
    _, res = _two_rounds(eng)
    info = res.history[-1]
    sizes = eng.sizes[info.client_ids].astype(np.float64)
    owner = np.repeat([0, 1], [len(p) for p in info.participants])
    for k in eng.buffer_names:
        rows = info.client_params[k].numpy().reshape(len(owner), -1)
        for g in range(2):
            w = sizes[owner == g]
            want = (rows[owner == g] * w[:, None]).sum(0) / w.sum()
            np.testing.assert_allclose(res.params[k][g].numpy().ravel(), want, rtol=0, atol=1e-12)
        # Round 2 started every client from its group's average (the state before the round).
        assert not torch.equal(info.start_params[k], res.history[0].start_params[k])


def test_stats_keeps_each_clients_running_statistics_local():
    off, on = _engine("off"), _engine("stats")
    assert on.local_names == on.buffer_names
    _, r_off = _two_rounds(off)
    _, r_on = _two_rounds(on)
    for k in off.names:  # train-mode BN normalises with batch statistics: parameters do not change
        assert torch.equal(r_off.params[k], r_on.params[k])
    first, second = r_on.history
    assert first.client_ids == second.client_ids
    momentum = 0.1
    for j, c in enumerate(second.client_ids):
        g = 0 if c < 3 else 1
        steps = on.schedule.num_steps(int(on.sizes[c]))
        decay = (1 - momentum) ** steps
        for k in on.buffer_names:
            own = first.client_params[k][j]  # client c's own statistics after round 1
            avg = second.start_params[k][g]  # its group's average after round 1
            # Both runs see the same batches in round 2; the exponential average only forgets
            # the starting value by (1 - momentum)^steps: FedBN started from its own.
            got = second.client_params[k][j] - r_off.history[1].client_params[k][j]
            torch.testing.assert_close(got, decay * (own - avg), rtol=0, atol=1e-12)
            assert not torch.allclose(own, avg)
    # The group's model still holds the FedAvg average of the local statistics (what eval uses).
    info = r_on.history[-1]
    w = torch.as_tensor(on.sizes[info.client_ids], dtype=torch.float64)
    for k in on.buffer_names:
        x = info.client_params[k][:3]
        want = (x * w[:3].view(-1, 1)).sum(0) / w[:3].sum()
        torch.testing.assert_close(r_on.params[k][0], want, rtol=0, atol=1e-12)


def test_layers_keeps_bn_weights_local_too():
    eng = _engine("layers")
    assert {n for n in eng.local_names if not n.endswith(("running_mean", "running_var"))} == {
        "net.1.weight",
        "net.1.bias",
    }
    _, off = _two_rounds(_engine("off"))
    _, on = _two_rounds(eng)
    assert not torch.equal(off.params["net.1.weight"], on.params["net.1.weight"])


@pytest.mark.parametrize("mode", ["stats", "layers"])
@pytest.mark.parametrize("method", ["fedshard", "fedavg"])
def test_fedbn_unlearning_is_bit_exact_float32(tmp_path, mode, method):
    def make():
        return METHODS[method](local_bn=mode)

    tr, run, _ = _fit_unlearn(tmp_path, make)
    assert tr.algorithm.engine.local_names
    res = _trainer(tmp_path, make()).audit(_model(), _data(), str(run), tolerance=0.0)
    assert res["passed"] and res["max_abs_diff"] == 0.0
    # FedBN changed the model (the statistics a client trains from are its own).
    plain = _trainer(tmp_path, METHODS[method]())
    plain.fit(_model(), _data())
    a, b = tr.algorithm.current_params(), plain.algorithm.current_params()
    assert any(not torch.equal(a[k], b[k]) for k in tr.algorithm.engine.local_names)
    assert not plain.algorithm.engine.local_names


def test_fedbn_refused_in_one_line_where_it_cannot_last(tmp_path):
    with pytest.raises(ConfigError, match=r"local_bn='stats': FATS trains round by round"):
        FATS(local_bn="stats")
    with pytest.raises(ConfigError, match=r"local_bn='bn': choose off, stats or layers"):
        FedShard(local_bn="bn")
    tr = _trainer(tmp_path, FedAvg(rounds=1, local_bn="stats"))
    with pytest.raises(ConfigError, match=r"MLP has no BatchNorm layer to keep local"):
        tr.fit(MLP(hidden=(4,)), _data())


def test_fedshard_shard_alphas_leave_batchnorm_statistics_out(tmp_path):
    """SPEC section 4: a shard's alpha is over its trainable parameters (numpy reference, stage 1)."""
    from _angles import numpy_signed_angles

    tr = _trainer(tmp_path, METHODS["fedshard"]())
    tr.fit(_model(), _data())
    alg = tr.algorithm
    trainable = sorted(n for n, p in tr.module.named_parameters() if p.requires_grad)
    assert any("running_mean" in k for k in alg.models[0])
    theta0, final = alg.theta0, alg.models[0]  # stage 1 starts every shard from theta^0
    u = np.stack(
        [
            np.concatenate([(final[k][s].double() - theta0[k].double()).numpy().ravel() for k in trainable])
            for s in range(len(alg.records[0]))
        ]
    )
    w = np.asarray([r.weight for r in alg.records[0]], dtype=np.float64)
    got = np.asarray([r.alpha for r in alg.records[0]])
    np.testing.assert_allclose(got, numpy_signed_angles(u, w), rtol=0, atol=1e-9)
