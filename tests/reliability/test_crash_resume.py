"""SIGKILL during ``fit``, then ``fit --ckpt_path RUN_DIR``: never a corrupt run, bit-identical result.

Three fits start as subprocesses when the session begins (conftest ``background``) and are killed
at moments found by polling the run directory (no hooks or environment variables in the code under
test): before the first cache commit, while cache version 2 is being written (its ``.tmp-`` folder
exists), and right after the last commit. Each is checked for consistency, then resumed in-process
and compared byte for byte with the uninterrupted reference run of the session.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from _reliability_helpers import (
    TINY,
    check_consistent,
    cli,
    crash_plans,
    current_version,
    describe,
    tmp_leftovers,
)

from fedshard_lightning.engine import FederatedEngine
from fedshard_lightning.flcache import FLCache


@pytest.fixture(scope="module")
def killed(background, tmp_path_factory):
    """name -> (run directory, Kill, what it left) for the three moments (see crash_plans)."""
    if not background.started("crash"):
        root = tmp_path_factory.mktemp("killed")
        background.start("crash", crash_plans(root), root)
    out = {}
    for name, k in background.results("crash").items():
        k.check_killed()
        out[name] = (k.run, k.kill, describe(k.run))
    return out


def _resume(run):
    return cli(["fit", *TINY, "--trainer.default_root_dir", str(run.parent), "--ckpt_path", str(run)])


def _check_killed_then_resumed(killed, name, reference_run):
    run, _, state = killed[name]
    check_consistent(run)  # never corrupt, whatever the moment
    code, out, err = _resume(run)
    assert code == 0, f"resume after a kill {state}: {err}"
    assert (run / "model.safetensors").read_bytes() == (reference_run / "model.safetensors").read_bytes(), (
        f"resumed model differs from the uninterrupted run (killed {state})"
    )
    current = check_consistent(run)
    assert FLCache(run / "cache").manifest(current)["complete"]
    assert tmp_leftovers(run / "cache") == [], "a resumed write removes the leftovers of the killed one"
    assert not [p for p in run.iterdir() if ".tmp-" in p.name]
    return state, out


def test_kill_before_first_commit_then_resume(killed, reference_run):
    _, _, state = killed["before_first_commit"]
    assert state == "before the first cache commit", state
    _check_killed_then_resumed(killed, "before_first_commit", reference_run)


def test_kill_while_writing_a_cache_version_then_resume(killed, reference_run):
    run, _, state = killed["writing_version_2"]
    # Polling sees the temporary folder within about a millisecond of a write that takes tens of them;
    # even when the kill lands just after the rename, CURRENT still names a complete version.
    assert current_version(run) in ("0001-stage-1", "0002-stage-2"), state
    _check_killed_then_resumed(killed, "writing_version_2", reference_run)


def test_kill_after_last_commit_then_resume(killed, reference_run):
    run, _, state = killed["after_last_commit"]
    assert current_version(run) == "0003-stage-3", state
    _, out = _check_killed_then_resumed(killed, "after_last_commit", reference_run)
    assert "fit done" in out


def test_same_seed_same_bytes_and_resumed_runs_match_across_processes(tmp_path, reference_run, killed):
    """Determinism through the CLI: a second fit of the same config and seed is byte-identical."""
    code, _, err = cli(["fit", *TINY, "--trainer.default_root_dir", str(tmp_path), "--trainer.run_name", "b"])
    assert code == 0, err
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (
        reference_run / "model.safetensors"
    ).read_bytes()
    a, b = FLCache(reference_run / "cache"), FLCache(tmp_path / "b" / "cache")
    assert a.manifest()["files"] == b.manifest()["files"], "every cached tensor file is byte-identical"
    assert a.manifest()["stacks"] == b.manifest()["stacks"], "every shard model blob is byte-identical"


def test_resume_with_auto_vectorize_keeps_the_runs_mode(tmp_path, monkeypatch, reference_run):
    auto = [a if a != "always" else "auto" for a in TINY]
    monkeypatch.setattr(FederatedEngine, "_probe", lambda self, start, batch: "loop")
    code, _, err = cli(
        ["fit", *auto, "--trainer.default_root_dir", str(tmp_path), "--trainer.run_name", "full"]
    )
    assert code == 0, err
    full = tmp_path / "full"
    partial = tmp_path / "partial"
    shutil.copytree(full, partial)
    FLCache(partial / "cache").set_current("0001-stage-1")
    (partial / "model.safetensors").unlink()
    # The resuming process happens to time the stacked mode as faster.
    monkeypatch.setattr(FederatedEngine, "_probe", lambda self, start, batch: "stacked")
    code, _, err = cli(
        ["fit", *auto, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(partial)]
    )
    assert code == 0, err
    a = FLCache(full / "cache").tensors("stage_3.safetensors")
    b = FLCache(partial / "cache").tensors("stage_3.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
