"""Unlearning trains all affected shards of a stage together, and only those, in one call per request."""

from __future__ import annotations

from _fedshard_helpers import make

from fedshard_lightning.engine import FederatedEngine


def test_one_engine_call_per_affected_stage_with_all_its_shards(run_root, monkeypatch):
    trainer, model, dm = make(run_root, k=8)
    trainer.fit(model, dm)
    alg = trainer.algorithm
    gone = [alg.records[0][0].clients[0], alg.records[0][1].clients[0]]  # two shards of stage 1
    # Independent reference from the frozen tree: per stage, the shards holding a leaving client
    # that keep at least one client.
    want = {}
    for p, recs in enumerate(alg.records, start=1):
        hit = [i for i, r in enumerate(recs) if set(r.clients) & set(gone) and set(r.clients) - set(gone)]
        if hit:
            want[p] = hit
    calls = []
    real = FederatedEngine.train_groups

    def counted(self, init, groups, stage=0, *args, **kwargs):
        calls.append((stage, [g.key for g in groups]))
        return real(self, init, groups, stage, *args, **kwargs)

    monkeypatch.setattr(FederatedEngine, "train_groups", counted)
    sequences = []
    real_stages = FederatedEngine.train_stages

    def counted_stages(self, jobs, init_of):
        sequences.append([(stage, [g.key for g in groups]) for stage, groups in jobs])
        return real_stages(self, jobs, init_of)

    monkeypatch.setattr(FederatedEngine, "train_stages", counted_stages)
    _, res = alg.what_if(alg.state_dict(), gone)
    assert sequences == [calls], "the whole request is one train_stages call, one job per stage"
    assert [s for s, _ in calls] == sorted(want), "one call per stage with affected shards, bottom-up"
    assert {s: keys for s, keys in calls} == want, "every affected shard of a stage in that stage's call"
    assert any(len(keys) > 1 for _, keys in calls), "the request touches two shards of some stage"
    got = {}
    for d in res.details["retrained_shards"]:
        got.setdefault(d["stage"], []).append(d["shard"])
    assert got == want
