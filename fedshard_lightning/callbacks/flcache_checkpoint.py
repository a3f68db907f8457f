"""FLCache checkpointing, configured like Lightning's ``ModelCheckpoint``: verification and retention of commits.

The loop commits the run's state to FLCache itself, atomically, once per stage of ``fit`` and once
per ``unlearn`` request (:mod:`fedshard_lightning.run.store`); a commit is never a callback's to make
or to skip. :class:`FLCacheCheckpoint` acts on each commit right after it: it re-reads every blob of
the new version against its SHA-256 (``verify``), and keeps the models of only the newest versions
(``keep_last``, as ``cache gc --keep N`` does; every manifest stays, as the history of requests).
"""

from __future__ import annotations

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.view import RunView
from fedshard_lightning.errors import ConfigError

__all__ = ["FLCacheCheckpoint"]


class FLCacheCheckpoint(FederatedCallback):
    """Verifies each FLCache commit and keeps the models of the newest versions only.

    Args:
        keep_last: Versions whose models stay loadable after each commit (the newest ones and the
            current one); ``None`` keeps every version (unlearning needs only the current one).
        verify: Read every blob of each new version back and check its SHA-256 (a disk that
            corrupts writes is found at the commit, not at the next load).
    """

    def __init__(self, keep_last: int | None = None, verify: bool = False) -> None:
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ConfigError(
                f"FLCacheCheckpoint.keep_last={keep_last!r}: give an integer >= 1, or null to keep all"
            )
        self.keep_last = keep_last
        self.verify = bool(verify)
        self.commits: list[str] = []

    def on_commit(self, run: RunView, version: str, label: str) -> None:
        """Verify the new version, then prune the models of versions older than the ``keep_last`` newest."""
        self.commits.append(version)
        cache = run.cache
        if self.verify:
            cache.verify(version)
        if self.keep_last is not None:
            cache.gc(self.keep_last)
