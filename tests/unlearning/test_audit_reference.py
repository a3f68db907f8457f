"""``audit``'s two checks: bit-equality with the run's engine, and the independent reference.

The reference (``unlearning/reference.py``) trains the run's record through the per-client loop
kernel and averages with a float64 sample-weighted mean of its own. In float64 it equals the
deployed model to rounding (about 1e-16 here); in float32 it differs by rounding amplified by
training, and the audit names that; a damaged model fails both checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _fedshard_helpers import fit, make, unlearn

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import Group
from fedshard_lightning.engine.kernels.loop import ClientBatch
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FATS, FedAvg
from fedshard_lightning.unlearning.reference import ReferenceReplay, certify, compare, weighted_mean


def _audit(root, run, **kw):
    trainer, model, dm = make(root, **kw)
    return trainer.audit(model, dm, str(run))


def _loaded(root, run, **kw):
    trainer, model, dm = make(root, **kw)
    trainer._load_run(model, dm, str(run), "audit")
    return trainer.algorithm


def test_float64_reference_equals_deployed_to_rounding_after_fit_and_unlearn(tmp_path, capsys):
    run = fit(tmp_path)
    after_fit = _audit(tmp_path, run)
    unlearn(tmp_path, run, [1, 5])
    after_unlearn = _audit(tmp_path, run)
    for res in (after_fit, after_unlearn):
        assert res["passed"] and res["bit_equal"] and res["dtype"] == "float64"
        diff = res["reference_max_abs_diff"]
        assert res["reference_passed"] and diff <= 1e-12, diff
        assert res["reference_rel_diff"] <= 1e-12
    out = capsys.readouterr().out
    assert "audit PASSED, bit-exact: float64; engine replay bit-equal" in out
    assert "unlearned clients [1, 5]" in out and "independent reference max|diff| = " in out


def test_float32_bit_equal_and_the_reference_difference_is_reported_and_named(tmp_path, capsys):
    run = fit(tmp_path, precision="32-true")
    unlearn(tmp_path, run, [1, 5], precision="32-true")
    capsys.readouterr()
    res = _audit(tmp_path, run, precision="32-true")
    out = capsys.readouterr().out
    assert res["passed"] and res["bit_equal"] and res["max_abs_diff"] == 0.0 and res["dtype"] == "float32"
    diff = res["reference_max_abs_diff"]
    assert np.isfinite(diff) and diff >= 0 and res["reference_rel_diff"] < res["reference_tolerance"]
    named = "max|diff| = 0.000e+00, relative 0.000e+00: none" if diff == 0 else "float32 rounding"
    assert named in out and "audit PASSED, bit-exact: float32" in out


@pytest.mark.parametrize(("precision", "scale"), [("64-true", 1 + 1e-6), ("32-true", 2.0)])
def test_a_damaged_deployed_model_fails_both_checks(tmp_path, precision, scale):
    run = fit(tmp_path, precision=precision)
    unlearn(tmp_path, run, [2, 6], precision=precision)
    alg = _loaded(tmp_path, run, precision=precision)
    name = next(iter(alg.models[-1]))
    if scale == 2.0:  # float32: a whole weight matrix; rounding allows more than one element's change
        alg.models[-1][name][0] *= scale
    else:
        alg.models[-1][name][0].view(-1)[0] *= scale
    res = certify(alg, 0.0)
    assert not res["engine_passed"] and not res["bit_equal"]
    assert not res["reference_passed"] and res["reference_rel_diff"] > res["reference_tolerance"]
    assert not res["passed"] and res["lines"][-1].startswith("audit FAILED")
    assert "more than rounding" in "\n".join(res["lines"])


def test_without_the_reference_the_engine_check_alone_decides(tmp_path):
    run = fit(tmp_path)
    trainer, model, dm = make(tmp_path)
    res = trainer.audit(model, dm, str(run), reference=False)
    assert res["passed"] and "reference_rel_diff" not in res
    assert "independent reference: skipped (reference: false)" in res["lines"]


def _baseline(root, algorithm):
    dm = SyntheticDataModule(
        num_clients=6,
        partition="dirichlet",
        rho=0.5,
        min_client_size=4,
        num_samples=72,
        num_test=20,
        shape=(5,),
    )
    torch.manual_seed(0)
    trainer = FederatedTrainer(
        algorithm=algorithm,
        precision="64-true",
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
    )
    return trainer, MLP(hidden=(8,), lr=0.1, momentum=0.5), dm


@pytest.mark.parametrize(
    "make_alg",
    [lambda: FedAvg(rounds=3, batch_size=5), lambda: FATS(rounds=4, sample_size=3, batch_size=5)],
    ids=["fedavg", "fats"],
)
def test_baselines_have_the_independent_reference(tmp_path, make_alg):
    trainer, model, dm = _baseline(tmp_path, make_alg())
    trainer.fit(model, dm)
    run = str(trainer.run_dir)
    trainer, model, dm = _baseline(tmp_path, make_alg())
    trainer.unlearn(model, dm, run, [0, 3])
    trainer, model, dm = _baseline(tmp_path, make_alg())
    res = trainer.audit(model, dm, run)
    assert res["passed"] and res["bit_equal"] and res["reference_max_abs_diff"] <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weighted_mean_is_numpys_weighted_average(dtype):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 3, 4, generator=gen, dtype=torch.float64).to(dtype)
    weights = [13, 1, 7, 22, 5, 9, 2]
    want = np.average(rows.double().numpy(), axis=0, weights=np.asarray(weights, dtype=np.float64))
    got = weighted_mean(rows, weights)
    assert got.dtype == dtype
    if dtype == torch.float64:
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-15, atol=0)
    else:  # the float64 mean rounded once to float32
        assert torch.equal(got, torch.from_numpy(want).to(dtype))
    with pytest.raises(ValueError, match="2 weights"):
        weighted_mean(rows, [1, 2])


def test_the_reference_round_is_numpys_sample_weighted_mean_of_the_loop_kernels_clients(tmp_path):
    run = fit(tmp_path)
    alg = _loaded(tmp_path, run)
    clients = (0, 3, 4, 7)
    replay = ReferenceReplay(alg.engine)
    theta = {k: v.clone() for k, v in alg.theta0.items()}
    got = replay.fedavg(theta, Group(2, clients, 1), stage=1)
    start = {k: v.unsqueeze(0).expand(len(clients), *v.shape).clone() for k, v in theta.items()}
    alone = alg.engine.local.train_loop(start, ClientBatch(list(clients), [2] * len(clients), 1, 0))
    sizes = np.asarray([float(alg.ctx.client_sizes[c]) for c in clients])
    for k, v in got.items():
        want = np.average(alone.params[k].numpy(), axis=0, weights=sizes)
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-15, atol=1e-300)
    assert compare(got, got).equal and replay.client_steps == int(alone.steps.sum())
