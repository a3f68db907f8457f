"""FLCacheCheckpoint: every loop commit is seen, verified and pruned; the model is the same as without it."""

from __future__ import annotations

import hashlib
import json

import pytest
from _tiny import small_synthetic

from fedshard_lightning import FederatedTrainer
from fedshard_lightning.callbacks import FederatedCallback, FLCacheCheckpoint
from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedShard


def _trainer(root, callbacks) -> FederatedTrainer:
    return FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=4),
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_fairness=False,
        vectorize="always",
        callbacks=callbacks,
        seed=3,
    )


def _version_dirs(cache) -> list[str]:
    """Committed versions read from the folder itself: one folder with a manifest.json each."""
    return sorted(p.name for p in cache.iterdir() if (p / "manifest.json").is_file())


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_keep_last_and_verify_see_every_commit_and_leave_the_model_alone(run_root):
    plain = _trainer(run_root / "plain", None)
    plain.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    ckpt = FLCacheCheckpoint(keep_last=1, verify=True)
    trainer = _trainer(run_root / "kept", [ckpt])
    trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    run, cache = trainer.run_dir, trainer.run_dir / "cache"
    assert ckpt.commits == _version_dirs(cache) and len(ckpt.commits) >= 3
    assert _sha(run / "model.safetensors") == _sha(plain.run_dir / "model.safetensors")
    pruned = json.loads((cache / "PRUNED").read_text())["versions"]
    assert sorted(pruned) == ckpt.commits[:-1], "only the newest version keeps its model"
    again = FLCacheCheckpoint(keep_last=1, verify=True)
    report = _trainer(run_root / "kept", [again]).unlearn(
        MLP(hidden=(8,), lr=0.1), small_synthetic(), ckpt_path=str(run), clients=[2]
    )
    assert again.commits == [report["cache_version"]] == _version_dirs(cache)[-1:]
    assert sorted(json.loads((cache / "PRUNED").read_text())["versions"]) == _version_dirs(cache)[:-1]


class _Corrupt(FederatedCallback):
    """Flips one byte of every blob once a version is committed, as a faulty disk would."""

    def on_commit(self, trainer, version, label):
        for blob in (trainer.run_dir / "cache" / "blobs").rglob("*"):
            if blob.is_file():
                data = bytearray(blob.read_bytes())
                data[-1] ^= 0xFF
                blob.write_bytes(bytes(data))


def test_verify_finds_a_blob_corrupted_after_the_commit(run_root):
    trainer = _trainer(run_root, [_Corrupt(), FLCacheCheckpoint(verify=True)])
    with pytest.raises(CacheError, match=r"0001-stage-1.*corrupted"):  # at the first commit
        trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_bad_keep_last_is_one_line_naming_the_field(keep):
    with pytest.raises(ConfigError, match=r"FLCacheCheckpoint\.keep_last="):
        FLCacheCheckpoint(keep_last=keep)


def _listed(trainer, kind) -> list:
    return [c for c in trainer.callbacks if isinstance(c, kind)]


def test_every_fit_commits_through_its_default_checkpoint_callback_and_logs_its_merges(run_root):
    trainer = _trainer(run_root, None)
    trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    (ckpt,) = _listed(trainer, FLCacheCheckpoint)
    assert ckpt is trainer.checkpoint_callback
    assert ckpt.commits == _version_dirs(trainer.run_dir / "cache") and len(ckpt.commits) >= 3
    assert (trainer.run_dir / "model.ckpt").is_file()
    lines = (trainer.run_dir / "merges.jsonl").read_text().splitlines()
    stages = [json.loads(line)["stage"] for line in lines]
    assert stages == list(range(1, len(ckpt.commits) + 1)), "one line per stage's grouping, stage 1 too"


def test_a_fit_without_checkpointing_keeps_only_its_final_model_and_unlearn_refuses(run_root):
    plain = _trainer(run_root / "plain", None)
    plain.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=4),
        default_root_dir=str(run_root / "final"),
        enable_progress_bar=False,
        enable_fairness=False,
        vectorize="always",
        enable_checkpointing=False,
        seed=3,
    )
    metrics = trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    run = trainer.run_dir
    assert trainer.checkpoint_callback is None and not _listed(trainer, FLCacheCheckpoint)
    assert sorted(p.name for p in (run / "cache").iterdir()) == ["FINAL_ONLY", "FINGERPRINT"]
    for name in ("model.safetensors", "model.ckpt"):  # the same model as a checkpointed fit's
        assert _sha(run / name) == _sha(plain.run_dir / name)
    tested = trainer.test(MLP(hidden=(8,), lr=0.1), small_synthetic(), ckpt_path=str(run))
    assert tested["test_accuracy"] == metrics["test_accuracy"]
    for command, args in (("unlearn", {"clients": [2]}), ("audit", {})):
        with pytest.raises(CacheError, match=rf"enable_checkpointing false\), so {command} cannot run"):
            getattr(_trainer(run_root / "final", None), command)(
                MLP(hidden=(8,), lr=0.1), small_synthetic(), ckpt_path=str(run), **args
            )
    with pytest.raises(CacheError, match=r"so fit cannot run: it is complete already"):
        _trainer(run_root / "final", None).fit(
            MLP(hidden=(8,), lr=0.1), small_synthetic(), ckpt_path=str(run)
        )
    assert _sha(run / "model.safetensors") == _sha(plain.run_dir / "model.safetensors")


def test_a_fit_killed_while_emptying_its_cache_is_still_refused_in_one_line(run_root, monkeypatch):
    import shutil

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt  # stands for a SIGKILL between the note and the removal

    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=4),
        default_root_dir=str(run_root),
        enable_progress_bar=False,
        enable_fairness=False,
        enable_checkpointing=False,
        seed=3,
    )
    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    monkeypatch.undo()
    assert not (trainer.run_dir / "cache" / "CURRENT").exists(), "the pointer goes before any blob"
    with pytest.raises(CacheError, match=r"kept only its final model"):
        _trainer(run_root, None).unlearn(
            MLP(hidden=(8,), lr=0.1), small_synthetic(), ckpt_path=str(trainer.run_dir), clients=[2]
        )


def test_save_ckpt_false_writes_no_lightning_checkpoint_at_fit_or_unlearn(run_root):
    trainer = _trainer(run_root, [FLCacheCheckpoint(save_ckpt=False)])
    trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    run = trainer.run_dir
    assert (run / "model.safetensors").is_file() and not (run / "model.ckpt").exists()
    _trainer(run_root, [FLCacheCheckpoint(save_ckpt=False)]).unlearn(
        MLP(hidden=(8,), lr=0.1), small_synthetic(), ckpt_path=str(run), clients=[2]
    )
    assert not (run / "model.ckpt").exists()


def test_checkpoint_callback_settings_that_cannot_act_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"enable_checkpointing=false, but trainer\.callbacks lists"):
        FederatedTrainer(enable_checkpointing=False, callbacks=[FLCacheCheckpoint()])
    with pytest.raises(ConfigError, match=r"lists 2 FLCacheCheckpoint callbacks"):
        FederatedTrainer(callbacks=[FLCacheCheckpoint(), FLCacheCheckpoint(verify=True)])
    with pytest.raises(ConfigError, match=r"FLCacheCheckpoint\.save_ckpt="):
        FLCacheCheckpoint(save_ckpt="no")
