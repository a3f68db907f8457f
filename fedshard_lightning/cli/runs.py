"""``python -m fedshard_lightning runs``: one line per run directory under a root.

A user with many runs needs to find the one to unlearn from or compare without opening files:
method, dataset, K, accuracy, requests applied and whether the fit completed or was interrupted
(and can be resumed), or is running now (a command holds its lock). Runs are found at any depth
under the root (``compare`` nests its methods' runs). Everything is read from what a run leaves behind (the current FLCache
manifest, ``config.yaml``, ``metrics.json``); nothing imports torch, so listing many runs takes a
fraction of a second. A run whose ``cache/CURRENT`` exists but whose manifest cannot be read is
listed as damaged, not as a run that never committed: resuming it would not work, verifying it tells
which file is at fault.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import yaml

from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.flcache.io import read_json_object
from fedshard_lightning.flcache.reader import CacheReader

__all__ = ["describe_run", "find_runs", "format_runs", "list_runs", "runs_main"]

COLUMNS = ("run", "method", "dataset", "K", "accuracy", "requests", "state")


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path) or {}


def _dataset(run: Path) -> str:
    """Dataset name from config.yaml's data class (``DigitsDataModule`` -> ``digits``)."""
    try:
        config = yaml.safe_load((run / "config.yaml").read_text()) or {}
        class_path = str(config["data"]["class_path"])
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):  # ValueError: not UTF-8
        return "-"
    return class_path.rsplit(".", 1)[-1].removesuffix("DataModule").lower() or "-"


def _locked(run: Path) -> bool:
    """True while a command holds the run's lock (``run_dir.run_lock``: ``flock`` on the folder)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: commands take no lock either
        return False
    try:
        fd = os.open(run, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


def describe_run(run: Path) -> dict[str, Any]:
    """The listing's row of one run directory (missing facts are ``-``)."""
    cache = CacheReader(run / "cache")
    manifest: dict[str, Any] = {}
    damaged = False
    if cache.exists():
        try:
            manifest = cache.manifest()
        except CacheError:
            damaged = True
    metrics = _read_json(run / "metrics.json")
    requests = manifest.get("requests") or []
    accuracy = requests[-1].get("test_accuracy_after") if requests else metrics.get("test_accuracy")
    busy = _locked(run)
    if busy and not manifest.get("complete"):
        state = "running"
    elif damaged:
        state = "damaged (cache verify --ckpt_path RUN names the file)"
    elif not manifest and (final := cache.final_only()) is not None:
        state = "complete, final model only (enable_checkpointing false: no unlearn or audit)"
        manifest = {k: v for k, v in final.items() if k in ("algorithm", "num_clients")}
    elif not manifest:
        if not (run / "cache").is_dir():
            state = "-"
        elif (run / "config.yaml").is_file():
            state = "interrupted (no stage committed: fit --ckpt_path RUN trains it from the start)"
        else:  # stopped before it recorded its settings: fit refuses to resume it
            state = "interrupted before its settings were recorded: remove it and run fit again"
    elif manifest.get("complete"):
        state = "complete (in use: unlearn, audit or test running)" if busy else "complete"
    else:
        state = "interrupted"
        done = manifest.get("stages_done")  # FLCache format 2; format 1 listed the stages
        if done is None and isinstance(manifest.get("stages"), list):
            done = len(manifest["stages"])
        if isinstance(done, int) and manifest.get("planned_stages"):
            state += f" (stage {done}/{manifest['planned_stages']} committed)"
    return {
        "run": str(run),
        "method": manifest.get("algorithm") or metrics.get("algorithm") or "-",
        "dataset": _dataset(run),
        "K": manifest.get("num_clients") or metrics.get("num_clients") or "-",
        "accuracy": f"{accuracy:.4f}" if isinstance(accuracy, (int, float)) else "-",
        "requests": len(requests),
        "state": state,
    }


def find_runs(root: Path) -> list[Path]:
    """Every run directory (a folder with ``cache/``) at any depth under ``root``; none inside another run."""
    found: list[Path] = []
    for folder, subdirs, _ in os.walk(root):
        here = Path(folder)
        if here != root and "cache" in subdirs:
            found.append(here)
            subdirs.clear()  # a run's own folders hold no runs
        else:
            subdirs.sort()
    return found


def _sort_key(run: Path, root: Path) -> list[tuple[str, int, str]]:
    """By path, folder by folder, ``version_10`` after ``version_9``."""
    key = []
    for name in run.relative_to(root).parts:
        stem, _, num = name.rpartition("_")
        key.append((stem, int(num), "") if num.isdigit() else (name, -1, name))
    return key


def list_runs(root: str | Path) -> list[dict[str, Any]]:
    """Rows of every run directory under ``root``, at any depth (compare's runs too), by path."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [describe_run(p) for p in sorted(find_runs(root), key=lambda p: _sort_key(p, root))]


def format_runs(rows: list[dict[str, Any]]) -> str:
    """A plain aligned table (reads the same in a terminal, a log file or a pasted issue)."""
    table = [list(COLUMNS)] + [[str(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in table)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"runs: {message}; runs takes only --root (see --help)")


def runs_main(argv: list[str]) -> None:
    """``runs [--root runs]``: print the listing."""
    parser = _Parser(
        prog="python -m fedshard_lightning runs", description="List the run directories under a root."
    )
    parser.add_argument("--root", default="runs", help="folder holding the runs (default: runs)")
    args = parser.parse_args(argv)
    if not Path(args.root).is_dir():  # a mistyped root must not read as an empty one
        raise ConfigError(
            f"runs --root {args.root}: no such folder; give the folder that holds the run "
            "directories (fit's trainer.default_root_dir, default runs)"
        )
    if (Path(args.root) / "cache").is_dir():
        raise ConfigError(f"runs --root {args.root}: this is a run directory; give the folder that holds it")
    rows = list_runs(args.root)
    if not rows:
        print(f"no runs under {args.root}")
        return
    print(format_runs(rows))
