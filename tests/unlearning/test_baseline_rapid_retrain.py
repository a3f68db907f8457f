"""RapidRetrain: the Fisher-preconditioned step against numpy, stacked rows, end-to-end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _baseline_helpers import fit, make, unlearn

from fedshard_lightning.callbacks import FederatedCallback
from fedshard_lightning.engine.optim import shrink_optimizer
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.flcache import FLCache
from fedshard_lightning.unlearning import FisherPreconditionedSGD, RapidRetrain

LR, BETA, DAMP = 0.05, 0.9, 1e-3


def _numpy_reference(p0, grads):
    p, f = p0.copy(), np.zeros_like(p0)
    for g in grads:
        f = BETA * f + (1 - BETA) * g * g
        p = p - LR * g / (f + DAMP)
    return p


def _run(p0, grads):
    p = torch.tensor(p0, requires_grad=True)
    opt = FisherPreconditionedSGD([p], lr=LR, momentum=BETA, damping=DAMP)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    return p.detach().numpy(), opt


def test_step_matches_numpy_single_tensor():
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=5)
    grads = [rng.normal(size=5) * s for s in (1.0, 0.1, 3.0, 0.01)]
    out, opt = _run(p0, grads)
    np.testing.assert_allclose(out, _numpy_reference(p0, grads), rtol=1e-12, atol=1e-14)
    f = np.zeros(5)
    for g in grads:
        f = BETA * f + (1 - BETA) * g * g
    np.testing.assert_allclose(next(iter(opt.state.values()))["fisher"].numpy(), f, rtol=1e-12)


def test_stacked_rows_do_not_couple_and_shrink_like_the_engine():
    """Four clients stacked [4, 3]; after two steps the engine retires the last two rows."""
    rng = np.random.default_rng(1)
    p0 = rng.normal(size=(4, 3))
    grads = [rng.normal(size=(4, 3)) * (i + 1) for i in range(4)]
    leaf = torch.tensor(p0, requires_grad=True)
    opt = FisherPreconditionedSGD([leaf], lr=LR, momentum=BETA, damping=DAMP)
    for g in grads[:2]:
        leaf.grad = torch.tensor(g)
        opt.step()
    done = leaf.detach()[2:].clone()
    new = leaf.detach()[:2].requires_grad_()
    shrink_optimizer(opt, [leaf], [new], 2)
    for g in grads[2:]:
        new.grad = torch.tensor(g[:2])
        opt.step()
    for row in range(4):
        steps = 4 if row < 2 else 2
        expected = _numpy_reference(p0[row], [g[row] for g in grads[:steps]])
        got = new.detach()[row] if row < 2 else done[row - 2]
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-14)


def test_unlearning_uses_the_fisher_optimizer_on_both_paths(run_root):
    trainer, model, dm = make(run_root, RapidRetrain, rounds=4)
    trainer.vectorize = "never"  # the per-client loop also builds the Fisher optimizer
    trainer.fit(model, dm)
    alg = trainer.algorithm
    assert alg.unlearn_rounds == 2
    assert alg.unlearn_engine.mode == "loop" and alg.engine.mode == "loop"
    assert alg.unlearn_engine.spec.cls is FisherPreconditionedSGD
    assert alg.unlearn_engine.local.spec is alg.unlearn_engine.spec
    assert alg.unlearn_engine.spec.groups[0][1] == {"lr": alg.lr, "momentum": 0.9, "damping": 1e-3}
    res = alg.unlearn([4])
    assert res.client_steps == res.predicted_client_steps == res.retrain_client_steps // 2
    assert torch.isfinite(torch.cat([v.reshape(-1) for v in res.params.values()])).all()
    # a different update rule than FedAvg retraining for the same rounds
    fa = fit(run_root, RapidRetrain, rounds=2, unlearned=[4]).algorithm.current_params()
    assert any(not torch.allclose(res.params[k], fa[k]) for k in fa)


class _KillAfterCommit(FederatedCallback):
    """Stops the fit once its one stage is committed (a kill before it leaves no run to resume)."""

    def on_stage_end(self, trainer, stage, metrics) -> None:
        raise KeyboardInterrupt("killed after the stage's commit")


def test_a_killed_fit_resumes_then_unlearns_and_refuses_audit(run_root):
    whole = fit(run_root, RapidRetrain, rounds=4).run_dir
    killed, model, dm = make(run_root, RapidRetrain, rounds=4, callbacks=[_KillAfterCommit()])
    with pytest.raises(KeyboardInterrupt):
        killed.fit(model, dm)
    run = killed.run_dir
    assert FLCache(run / "cache").versions() == ["0001-stage-0"]
    assert not (run / "model.safetensors").exists()
    resumer, model, dm = make(run_root, RapidRetrain, rounds=4)
    assert resumer.fit(model, dm, ckpt_path=str(run))["resumed"]
    assert (run / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()

    reports = [unlearn(run_root, r, RapidRetrain, [4], rounds=4) for r in (run, whole)]
    assert (
        reports[0]["client_steps"] == reports[0]["predicted_client_steps"] == reports[1]["client_steps"] > 0
    )
    assert reports[0]["unlearn_rounds"] == 2
    assert (run / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    trainer, model, dm = make(run_root, RapidRetrain, rounds=4)
    with pytest.raises(ConfigError, match="does not support audit"):
        trainer.audit(model, dm, str(run))
