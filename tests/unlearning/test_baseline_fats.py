"""FATS: rollback to the first participation, exact equality with FATS trained without the client."""

from __future__ import annotations

import pytest
import torch
from _baseline_helpers import fit, make, max_diff, unlearn

from fedshard_lightning.callbacks import FederatedCallback
from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache import FLCache
from fedshard_lightning.unlearning import FATS
from fedshard_lightning.unlearning.context import AlgorithmContext

SCRIPT = {0: [0, 2], 1: [2, 3], 2: [1, 3], 3: [0, 4]}


def scripted(self, round_, population):
    """A scripted sampler that, like the real one, only drops clients who left."""
    allowed = set(population)
    return [c for c in SCRIPT[round_] if c in allowed]


def _participants(alg):
    """Each round's participants in the algorithm's current state."""
    return alg.participants_of()


def test_rollback_starts_at_first_participation(run_root, monkeypatch):
    monkeypatch.setattr(FATS, "sample", scripted)
    alg = fit(run_root, FATS, rounds=4).algorithm
    assert _participants(alg) == [SCRIPT[r] for r in range(4)]
    steps_per_client = alg.engine.client_steps_of([0])
    before = {k: v.clone() for k, v in alg.state.models.items()}

    never = alg.unlearn([5])
    assert never.client_steps == never.predicted_client_steps == 0
    assert never.details["rollback_round"] is None and never.details["retrained_rounds"] == []
    assert all(torch.equal(never.params[k], before[k][-1]) for k in before)

    res = alg.unlearn([1])
    assert res.details["rollback_round"] == 2 and res.details["retrained_rounds"] == [2, 3]
    assert res.client_steps == res.predicted_client_steps == 3 * steps_per_client  # {3} then {0, 4}
    assert res.retrain_client_steps == 7 * steps_per_client
    assert all(torch.equal(alg.state.models[k][:3], before[k][:3]) for k in before)
    assert not all(torch.equal(alg.state.models[k][3], before[k][3]) for k in before)
    assert _participants(alg) == [[0, 2], [2, 3], [3], [0, 4]]

    reference = fit(run_root, FATS, rounds=4, unlearned=[1, 5]).algorithm
    assert max_diff(res.params, reference.current_params()) <= 1e-10

    res2 = alg.unlearn([2])  # requests accumulate: first round 0 now
    assert res2.details["retrained_rounds"] == [0, 1, 2, 3]
    reference2 = fit(run_root, FATS, rounds=4, unlearned=[1, 2, 5]).algorithm
    assert max_diff(res2.params, reference2.current_params()) <= 1e-10
    assert _participants(alg) == _participants(reference2)


def test_keyed_sampler_unlearning_equals_training_without_the_client(run_root):
    alg = fit(run_root, FATS, rounds=4, sample_size=2).algorithm
    for r, parts in enumerate(_participants(alg)):
        assert parts == sorted(set(parts)) and 1 <= len(parts) <= 2
        assert parts == alg.sample(r, range(6))
    taken = [c for p in _participants(alg) for c in p]
    leaving = taken[-1]
    first = next(r for r, p in enumerate(_participants(alg)) if leaving in p)
    res = alg.unlearn([leaving])
    assert res.details["rollback_round"] == first
    assert res.details["first_participation"] == {str(leaving): first}
    reference = fit(run_root, FATS, rounds=4, sample_size=2, unlearned=[leaving]).algorithm
    assert max_diff(res.params, reference.current_params()) <= 1e-10
    assert res.client_steps == res.predicted_client_steps
    assert _participants(alg) == _participants(reference)


def test_sampler_is_uniform_with_replacement_and_coupled():
    """Rejection from all ids: uniform over the population; removing an undrawn client changes nothing."""
    alg = FATS(sample_size=3)
    alg.ctx = AlgorithmContext(make_engine=None, client_sizes=[1] * 10, seed=7)
    counts = torch.zeros(10)
    for r in range(400):
        for c in alg.sample(r, [1, 3, 4, 8]):
            counts[c] += 1
        full = alg.sample(r, range(10))
        for gone in set(range(10)) - set(full):
            assert alg.sample(r, [c for c in range(10) if c != gone]) == full
    assert counts[[0, 2, 5, 6, 7, 9]].sum() == 0
    share = counts[[1, 3, 4, 8]] / counts.sum()
    assert torch.allclose(share, torch.full((4,), 0.25), atol=0.05)


class _KillAfterRound(FederatedCallback):
    """Stops the fit once round 1 (a FATS round is one stage) is committed."""

    def on_stage_end(self, trainer, stage, metrics) -> None:
        if stage == 1:
            raise KeyboardInterrupt("killed after round 1")


def test_a_fit_killed_after_a_round_resumes_then_unlearns_and_audits(run_root):
    whole = fit(run_root, FATS, rounds=4, sample_size=3).run_dir
    killed, model, dm = make(run_root, FATS, rounds=4, sample_size=3, callbacks=[_KillAfterRound()])
    with pytest.raises(KeyboardInterrupt):
        killed.fit(model, dm)
    run = killed.run_dir
    assert FLCache(run / "cache").versions() == ["0001-stage-0", "0002-stage-1"]  # one commit per round
    assert not FLCache(run / "cache").manifest()["complete"]
    resumer, model, dm = make(run_root, FATS, rounds=4, sample_size=3)
    assert resumer.fit(model, dm, ckpt_path=str(run))["resumed"]
    assert len(resumer.algorithm.participants_of()) == 4
    assert (run / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()

    leaving = next(c for c in range(6) if resumer.algorithm.first_round([c]) not in (None, 0))
    reports = [unlearn(run_root, r, FATS, [leaving], rounds=4, sample_size=3) for r in (run, whole)]
    assert (
        reports[0]["client_steps"] == reports[0]["predicted_client_steps"] == reports[1]["client_steps"] > 0
    )
    assert reports[0]["rollback_round"] == reports[1]["rollback_round"] > 0
    assert (run / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    trainer, model, dm = make(run_root, FATS, rounds=4, sample_size=3)
    result = trainer.audit(model, dm, str(run))
    assert result["passed"] and result["max_abs_diff"] == 0.0


def test_an_unfinished_fit_refuses_requests_and_says_how_far_it_got(run_root):
    killed, model, dm = make(run_root, FATS, rounds=4, sample_size=3, callbacks=[_KillAfterRound()])
    with pytest.raises(KeyboardInterrupt):
        killed.fit(model, dm)
    with pytest.raises(
        CacheError, match=r"training stopped after round 2 of 4; resume it with fit --ckpt_path"
    ):
        unlearn(run_root, killed.run_dir, FATS, [0], rounds=4, sample_size=3)
