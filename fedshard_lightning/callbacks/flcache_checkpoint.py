"""FLCache checkpointing, configured like Lightning's ``ModelCheckpoint``: verification, retention and exports.

The loop commits the run's state to FLCache itself, atomically, once per stage of ``fit`` and once
per ``unlearn`` request (:mod:`fedshard_lightning.run.store`): a commit is never a callback's to
make or to skip, since exact unlearning reads it. Every trainer carries one
:class:`FLCacheCheckpoint` (``trainer.checkpoint_callback``; the default one unless ``callbacks``
lists its own), and every commit and deployed model goes through its settings:

* ``verify``: right after each commit, every blob of the new version is read back and checked
  against its SHA-256 (a disk that corrupts writes is found at the commit, not at the next load);
* ``keep_last``: only the newest versions keep their models (as ``cache gc --keep N``; every
  manifest stays, as the history of requests; unlearning needs only the current version);
* ``save_ckpt``: besides ``model.safetensors`` (always written: ``test``, ``load_model`` and the
  reports read it), the Lightning checkpoint ``model.ckpt`` that ``YourModule.load_from_checkpoint``
  loads.

As in Lightning, ``trainer.enable_checkpointing: false`` means no such callback: the fit keeps only
its final model, and ``unlearn`` and ``audit`` on that run refuse (they retrain from the cache).
"""

from __future__ import annotations

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.view import RunView
from fedshard_lightning.errors import ConfigError

__all__ = ["FLCacheCheckpoint"]


class FLCacheCheckpoint(FederatedCallback):
    """Verifies each FLCache commit, keeps the models of the newest versions, says what the model is exported as.

    Args:
        keep_last: Versions whose models stay loadable after each commit (the newest ones and the
            current one); ``None`` keeps every version (unlearning needs only the current one).
        verify: Read every blob of each new version back and check its SHA-256.
        save_ckpt: Also write the deployed model as the Lightning checkpoint ``model.ckpt`` (no
            pickled objects: ``weights_only`` loading accepts it); ``model.safetensors`` is always
            written.
    """

    def __init__(self, keep_last: int | None = None, verify: bool = False, save_ckpt: bool = True) -> None:
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ConfigError(
                f"FLCacheCheckpoint.keep_last={keep_last!r}: give an integer >= 1, or null to keep all"
            )
        for name, value in (("verify", verify), ("save_ckpt", save_ckpt)):
            if not isinstance(value, bool):
                raise ConfigError(f"FLCacheCheckpoint.{name}={value!r}: give true or false")
        self.keep_last = keep_last
        self.verify = verify
        self.save_ckpt = save_ckpt
        self.commits: list[str] = []

    def on_commit(self, run: RunView, version: str, label: str) -> None:
        """Verify the new version, then prune the models of versions older than the ``keep_last`` newest."""
        self.commits.append(version)
        cache = run.cache
        if self.verify:
            cache.verify(version)
        if self.keep_last is not None:
            cache.gc(self.keep_last)
