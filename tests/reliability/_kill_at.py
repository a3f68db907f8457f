"""Kill a process with SIGKILL at a moment read from its run directory (stdlib only).

Run as its own small process (``python -I -S _kill_at.py PID RUN_DIR CONDITION``) so that polling
is never held up by the test process's GIL: a cache version is written in about 10 ms, and a
watcher thread inside a busy pytest process can sleep through that window.

Conditions (``RUN_DIR`` relative):

* ``dir``: the run directory exists;
* ``file:REL``: ``REL`` exists;
* ``tmp:PREFIX``: ``cache/`` holds a ``PREFIX...tmp-PID`` entry (a version being written);
* ``current:PREFIX``: ``cache/CURRENT`` names a version starting with ``PREFIX``;
* ``journal:EVENT``: ``unlearning/journal.jsonl`` has an entry with that event;
* ``changed:REL``: ``REL`` was replaced since the watcher started (another inode or mtime).

Prints ``killed`` or ``exited`` (the process ended first) or ``timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

_FIRST: dict[str, tuple[int, int] | None] = {}


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def met(run: Path, condition: str) -> bool:
    """Whether ``condition`` holds for the run directory ``run`` now."""
    kind, _, arg = condition.partition(":")
    if kind == "changed":
        now = _stat(run / arg)
        first = _FIRST.setdefault(arg, now)
        return now != first
    try:
        if kind == "dir":
            return run.is_dir()
        if kind == "file":
            return (run / arg).exists()
        if kind == "tmp":
            return any(n.startswith(arg) and ".tmp-" in n for n in os.listdir(run / "cache"))
        if kind == "current":
            return json.loads((run / "cache" / "CURRENT").read_text())["version"].startswith(arg)
        if kind == "journal":
            lines = (run / "unlearning" / "journal.jsonl").read_text().splitlines()
            return any(f'"event": "{arg}"' in line for line in lines)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    raise ValueError(f"unknown condition {condition!r}")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Poll about every millisecond; kill at the moment (after ``--delay`` seconds)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("pid", type=int)
    parser.add_argument("run", type=Path)
    parser.add_argument("condition")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    met(args.run, args.condition)  # unknown conditions fail here
    end = time.monotonic() + args.timeout
    polls = 0
    while time.monotonic() < end:
        if met(args.run, args.condition):
            if args.delay:
                time.sleep(args.delay)
            if not alive(args.pid):
                print("exited", flush=True)
                return 0
            os.kill(args.pid, signal.SIGKILL)
            print("killed", flush=True)
            return 0
        polls += 1
        if polls % 25 == 0 and not alive(args.pid):
            print("exited", flush=True)
            return 0
        # Python start-up takes seconds before the run directory appears: poll slowly until then.
        time.sleep(0.001 if args.run.is_dir() else 0.02)
    print("timeout", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
