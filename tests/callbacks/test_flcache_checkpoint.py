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
