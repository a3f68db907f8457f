"""SIGKILL during ``unlearn``: the cache is entirely before or entirely after the request.

Two ``unlearn --clients [2]`` subprocesses on copies of the reference run (started when the session
begins, conftest ``background``) are killed:
one as soon as the journal records the request as started (it is still computing), one as soon
as ``cache/CURRENT`` names the new version (the report and journal are still to be written).
Re-running the request completes it (or reports it as already applied, without a new version),
and both copies end with the same bytes. A crash right after the commit is also simulated
in-process to check what recovery rebuilds.
"""

from __future__ import annotations

import json

import pytest
import torch
from _reliability_helpers import (
    UNLEARN_CLIENTS,
    check_consistent,
    cli,
    copy_run,
    current_version,
    journal,
    tmp_leftovers,
    unlearn_plans,
)

from fedshard_lightning.flcache import FLCache, load_tensors
from fedshard_lightning.trainer import FederatedTrainer

CLIENTS = UNLEARN_CLIENTS


def _unlearn(run, reference_run):
    return cli(
        [
            "unlearn",
            "--config",
            str(reference_run / "config.yaml"),
            "--ckpt_path",
            str(run),
            "--clients",
            CLIENTS,
        ]
    )


@pytest.fixture(scope="module")
def killed(background, tmp_path_factory, reference_run):
    """name -> (run directory, what the cache held after the kill: 'before' or 'after')."""
    if not background.started("unlearn"):
        root = tmp_path_factory.mktemp("unlearn_killed")
        background.start("unlearn", unlearn_plans(root, reference_run), root)
    out = {}
    for name, k in background.results("unlearn").items():
        k.check_killed()
        out[name] = (k.run, _side(k.run, reference_run))
    return out


def _side(run, reference_run) -> str:
    """'before' or 'after' the request; fails on anything in between."""
    current = check_consistent(run)
    cache, ref = FLCache(run / "cache"), FLCache(reference_run / "cache")
    manifest, ref_manifest = cache.manifest(), ref.manifest()
    if manifest["unlearned"] == []:
        assert current == ref.current() and manifest == ref_manifest
        return "before"
    assert manifest["unlearned"] == [2] and [r["clients"] for r in manifest["requests"]] == [[2]]
    assert current.endswith("unlearn-0001")
    assert manifest["files"]["theta0.safetensors"] == ref_manifest["files"]["theta0.safetensors"]
    for p in (1, 2, 3):  # client 2 is in one shard of every stage: exactly that shard's blob is new
        name = f"stage_{p}"
        new, old = cache.stack_digests(name), ref.stack_digests(name)
        assert sum(a != b for a, b in zip(new, old)) == 1, name
    assert manifest["files"] == ref_manifest["files"]  # theta0 and the frozen structure are shared
    return "after"


def _versions(run):
    return FLCache(run / "cache").versions()


def test_kill_while_computing_leaves_the_cache_before_then_rerun_completes(killed, reference_run):
    run, side = killed["after_started"]
    assert side == "before"
    versions = _versions(run)
    code, out, err = _unlearn(run, reference_run)
    assert code == 0, err
    assert "removed" in out
    assert _side(run, reference_run) == "after"
    assert len(_versions(run)) == len(versions) + 1
    assert tmp_leftovers(run / "cache") == []
    report = json.loads((run / "unlearning" / "0001" / "report.json").read_text())
    assert report["clients"] == [2] and report["cache_version"] == current_version(run)
    events = [(e["event"], e["request"]) for e in journal(run)]
    assert events[-1] == ("committed", 1) and events.count(("started", 1)) == 2


def test_kill_after_commit_leaves_the_cache_after_then_rerun_reports_it(killed, reference_run):
    run, side = killed["after_commit"]
    assert side == "after"
    versions = _versions(run)
    code, out, err = _unlearn(run, reference_run)
    assert code == 0, err
    assert "already unlearned" in out
    assert _versions(run) == versions, "an applied request is not applied twice"
    params = FLCache(run / "cache").tensors("stage_3.safetensors")
    model = load_tensors(run / "model.safetensors")
    assert all(torch.equal(model[k], v[0]) for k, v in params.items()), "model.safetensors recovered"
    assert json.loads((run / "unlearning" / "0001" / "report.json").read_text())["clients"] == [2]


def test_both_crashes_end_in_the_same_state_and_a_third_run_changes_nothing(killed, reference_run):
    a, _ = killed["after_started"]
    b, _ = killed["after_commit"]
    for run in (a, b):  # completes the request, or reports it (when the tests above ran first)
        code, _, err = _unlearn(run, reference_run)
        assert code == 0, err
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    ma, mb = FLCache(a / "cache").manifest(), FLCache(b / "cache").manifest()
    assert (ma["files"], ma["stacks"]) == (mb["files"], mb["stacks"])
    for run in (a, b):
        versions = _versions(run)
        code, out, err = _unlearn(run, reference_run)
        assert code == 0 and "already unlearned" in out, err
        assert _versions(run) == versions


class _Crash(BaseException):
    """Stands for a kill: escapes every ``except Exception``."""


@pytest.fixture(scope="module")
def crashed_after_commit(tmp_path_factory, reference_run):
    """A run whose unlearn 'died' in _write_model, right after the cache commit; then re-run."""
    run = copy_run(reference_run, tmp_path_factory.mktemp("crash_after_commit") / "run")
    mp = pytest.MonkeyPatch()

    def die(self, params):
        raise _Crash

    mp.setattr(FederatedTrainer, "_write_model", die)
    try:
        with pytest.raises(_Crash):
            _unlearn(run, reference_run)
    finally:
        mp.undo()
    assert _side(run, reference_run) == "after"
    assert [e["event"] for e in journal(run)] == ["started"]
    code, out, err = _unlearn(run, reference_run)
    assert code == 0 and "already unlearned" in out, err
    return run


def test_journal_agrees_with_the_cache_after_recovery(crashed_after_commit):
    events = journal(crashed_after_commit)
    started = {e["request"] for e in events if e["event"] == "started"}
    committed = {e["request"] for e in events if e["event"] == "committed"}
    assert started == committed == {1}


def test_recovered_report_names_its_cache_version(crashed_after_commit):
    report = json.loads((crashed_after_commit / "unlearning" / "0001" / "report.json").read_text())
    assert report.get("cache_version") == current_version(crashed_after_commit)
