"""FedEraser and FedRecover as planners: resume after a kill, one round held in memory, one file per round.

Both train one plan per round (stage = round) and keep their retained rounds in FLCache; the
state holds the newest retained round only. A fit killed after a round resumes from its last
commit and gives the same bits as an uninterrupted one, and so does a request after it.
"""

from __future__ import annotations

import pytest
import torch
from _baseline_helpers import fit, make

from fedshard_lightning.callbacks import FederatedCallback
from fedshard_lightning.flcache import FLCache
from fedshard_lightning.unlearning import FedEraser, FedRecover
from fedshard_lightning.unlearning.history import round_file

METHODS = {
    "federaser": (FedEraser, {"rounds": 4, "delta_t": 2, "local_epochs": 2}),
    "fedrecover": (
        FedRecover,
        {"rounds": 5, "warmup_rounds": 1, "correction_period": 2, "final_tuning_rounds": 1},
    ),
}


class _KillAfterRound1(FederatedCallback):
    def on_stage_end(self, trainer, stage, metrics) -> None:
        if stage == 1:
            raise KeyboardInterrupt("killed after round 1")


@pytest.mark.parametrize("method", list(METHODS))
def test_fit_killed_after_a_round_resumes_and_unlearns_like_an_uninterrupted_one(run_root, method):
    factory, kw = METHODS[method]
    whole = fit(run_root, factory, **kw)

    killed, model, dm = make(run_root, factory, callbacks=[_KillAfterRound1()], **kw)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(model, dm)
    run = killed.run_dir
    assert FLCache(run / "cache").versions() == ["0001-stage-0", "0002-stage-1"]
    resumed, model, dm = make(run_root, factory, **kw)
    assert resumed.fit(model, dm, ckpt_path=str(run))["resumed"]
    assert (run / "model.safetensors").read_bytes() == (whole.run_dir / "model.safetensors").read_bytes()
    assert resumed.algorithm.total_client_steps == whole.algorithm.total_client_steps

    reports = []
    for r in (whole.run_dir, run):
        t, model, dm = make(run_root, factory, **kw)
        reports.append(t.unlearn(model, dm, str(r), [1]))
    assert (
        reports[0]["client_steps"] == reports[1]["client_steps"] == reports[1]["predicted_client_steps"] > 0
    )
    assert (run / "model.safetensors").read_bytes() == (whole.run_dir / "model.safetensors").read_bytes()


def test_the_state_holds_one_round_and_the_cache_writes_each_round_once(run_root):
    trainer = fit(run_root, FedRecover, rounds=3, warmup_rounds=1, correction_period=2)
    alg, cache = trainer.algorithm, FLCache(trainer.run_dir / "cache")
    assert alg.state.rounds_trained == 3 and alg.history.rounds == [0, 1, 2]
    assert {k.split("/")[0] for k in alg.state.recorded} == {"r0002"}  # the rest is read from the cache
    versions = cache.versions()
    assert versions == ["0001-stage-0", "0002-stage-1", "0003-stage-2"]
    digests = [cache.manifest(v)["files"].get(round_file(0)) for v in versions]
    assert digests[0] is not None and digests == [digests[0]] * 3  # one blob, shared by every version
    start, _ = alg.history.load(0, "cpu")
    assert all(torch.equal(start[k], alg.theta0[k]) for k in start)

    before, saved = alg.state, {k: v.clone() for k, v in alg.current_params().items()}
    new, result = alg.what_if(before, [2])
    assert alg.state is before and new.unlearned == (2,) and new.recorded is None
    assert all(torch.equal(alg.current_params()[k], saved[k]) for k in saved)
    assert result.client_steps == result.predicted_client_steps == alg.predict_cost([2]) > 0
    assert cache.versions() == versions


def test_a_process_that_does_not_write_the_cache_reads_the_rounds_from_it(run_root):
    """DDP: only rank zero commits; the other ranks are told of each commit and read the rounds back."""
    trainer = fit(run_root, FedEraser, rounds=4, delta_t=2, local_epochs=2)
    alg = trainer.algorithm
    expected = alg.what_if(alg.state, [3])[1].params
    alg._history_cache = None  # as on a rank that never wrote a version
    trainer.store.write = False
    trainer._events.checkpoint("again")
    got = alg.what_if(alg.state, [3])[1].params
    assert all(torch.equal(got[k], expected[k]) for k in expected)
