"""``python -m fedshard_lightning cache gc|verify``: maintenance of a run's FLCache without a config.

``gc --keep N`` keeps the models of the N newest versions (and of the current one) and drops every
other blob; every manifest and every stack index stays, so the history of requests and the digest of
every model that each version had remain provable (see :meth:`FLCache.gc`). ``verify`` checks
every blob of the current version against its digest; ``--all`` checks every version, and the
chain of manifest checksums from ``CURRENT`` back to the first commit (a byte flipped in an old
version's manifest or blob is found).

Like ``unlearn``, both take the run directory's lock (a second process stops with a one-line
error) and the cache's writer lock; errors are one line, exit status 2.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.flcache.gc import final_only_error
from fedshard_lightning.flcache.io import _flock
from fedshard_lightning.run.directory import check_real_folders
from fedshard_lightning.run.request_history import check_history

__all__ = ["cache_main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        if "required: {gc,verify}" in message:
            message = "name a subcommand, gc or verify (each has its own --help)"
        raise ConfigError(f"cache: {message}")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="python -m fedshard_lightning cache",
        description="Maintenance of a run's FLCache without a config.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="{gc,verify}")
    gc = sub.add_parser("gc", help="drop the models of old versions; keep every manifest")
    gc.add_argument("--ckpt_path", required=True, help="run directory created by fit")
    gc.add_argument("--keep", required=True, type=int, help="newest versions whose models stay (>= 1)")
    verify = sub.add_parser("verify", help="check every blob against its SHA-256")
    verify.add_argument("--ckpt_path", required=True, help="run directory created by fit")
    verify.add_argument("--all", action="store_true", help="every version, not only the current one")
    return ap


def _cache_of(ckpt_path: str) -> tuple[Path, FLCache]:
    run = Path(ckpt_path)
    if not run.is_dir() or not (run / "cache").is_dir():
        raise CacheError(
            f"ckpt_path={ckpt_path!r} is not a fedshard_lightning run directory (no cache/ inside)"
        )
    check_real_folders(run)  # gc removes blobs: never through a link
    cache = FLCache(run / "cache")
    if cache.final_only() is not None:
        raise final_only_error(run, "cache")
    if not cache.exists():
        raise CacheError(f"{run} has no committed FLCache (cache/CURRENT); nothing to do")
    return run, cache


def cache_main(argv: list[str]) -> None:
    """Run ``cache gc`` or ``cache verify``; raises :class:`FedShardError` subclasses for user errors."""
    args = _parser().parse_args(argv)
    run, cache = _cache_of(args.ckpt_path)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    if rank != 0:
        return
    busy = (
        f"ckpt_path={run}: another process is unlearning from this run or collecting its cache now; "
        "wait for it to finish, then run this again"
    )
    with _flock(run, blocking=False, busy=busy):
        check_history(run, cache)  # a rolled-back cache is neither collected nor called intact
        if args.command == "gc":
            if args.keep < 1:
                raise ConfigError(f"--keep={args.keep}: keep at least the newest version (an integer >= 1)")
            out = cache.gc(args.keep)
            kept = _count(len(out["kept"]), "version")
            span = out["kept"][0] if len(out["kept"]) == 1 else f"{out['kept'][0]} .. {out['kept'][-1]}"
            print(
                f"cache gc: kept the models of {kept} ({span}), "
                f"{_count(len(out['pruned']), 'version')} pruned (manifests kept); removed {out['removed_blobs']} blobs "
                f"({out['removed_bytes'] / 1e6:.1f} MB), {out['kept_blobs']} blobs ({out['kept_bytes'] / 1e6:.1f} MB) "
                f"remain in {cache.root}"
            )
        else:
            if args.all:
                found = cache.verify_all()
                versions = found["chain"] + found["other"]
            else:
                versions = [cache.current()]
                cache.verify(versions[0])
            pruned = len(set(versions) & cache.pruned())
            note = f" ({pruned} pruned by gc: their indexes only)" if pruned else ""
            if args.all and found["other"]:
                note += f" ({len(found['other'])} off the current history: blobs only)"
            n = len(versions)
            print(f"cache verify: {n} version{'s' if n != 1 else ''} intact{note} in {cache.root}")


def _count(n: int, noun: str) -> str:
    """``1 version``, ``3 versions``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
