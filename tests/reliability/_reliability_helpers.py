"""Shared pieces of the reliability tests: a tiny CLI config, in-process runs, killed subprocesses.

Python start-up costs several seconds here, so a subprocess is used only where a SIGKILL is the
point of the test; everything else goes through ``fedshard_lightning.cli.main`` in-process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _cli import cli as cli  # re-exported: the reliability tests and scripts/ import it from here

from fedshard_lightning.flcache import FLCache, load_tensors

ROOT = Path(__file__).resolve().parents[2]

#: Digits, 8 clients (3 stages), A2 rounds in [1, 2], 2 local steps: about 1 s of training per stage.
TINY = [
    "--data.num_clients",
    "8",
    "--trainer.algorithm.rounds",
    "a2",
    "--trainer.algorithm.t0",
    "1",
    "--trainer.algorithm.t1",
    "2",
    "--trainer.algorithm.local_steps",
    "2",
    "--trainer.vectorize",
    "always",
    "--trainer.eval_every_n_rounds",
    "0",
    "--trainer.enable_progress_bar",
    "false",
]


def copy_run(src: Path, dst: Path) -> Path:
    """An independent copy of a run directory (hard links of the cache become separate files)."""
    shutil.copytree(src, dst)
    return dst


def error_lines(err: str) -> list[str]:
    """Non-empty stderr lines other than Lightning's 'Seed set to' info line."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith("Seed set to")]


def snapshot(root: Path) -> dict[Path, bytes]:
    """Bytes of every file under ``root`` (hidden ones included)."""
    return {p: p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def tree_hash(root: Path) -> str:
    """SHA-256 over every path under ``root`` with its mode and bytes (links: their target)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            h.update(f"{p.relative_to(root)}\0{st.st_mode:o}\0".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode())
            elif p.is_file():
                h.update(p.read_bytes())
    return h.hexdigest()


def changed_files(before: dict[Path, bytes]) -> list[str]:
    """Files of a snapshot that are gone or differ now."""
    return [str(p) for p, b in before.items() if not p.is_file() or p.read_bytes() != b]


def tmp_leftovers(directory: Path) -> list[str]:
    """``.NAME.tmp-PID`` entries directly inside ``directory``."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and ".tmp-" in p.name)


def check_consistent(run: Path) -> str | None:
    """Everything a crash may leave must be loadable; returns the current version (None: no cache yet).

    Whenever ``cache/CURRENT`` exists, it must name a complete version whose files match their
    checksums, and so must every committed version folder; ``model.safetensors`` and the JSON
    files of the run directory are written atomically, so they are whole or absent.
    """
    cache = FLCache(run / "cache")
    current = None
    if cache.exists():
        current = cache.current()
        cache.verify(current)
        for version in cache.versions():
            cache.verify(version)
    if (run / "model.safetensors").exists():
        load_tensors(run / "model.safetensors")
    for name in ("metrics.json", "unlearn_report.json"):
        if (run / name).exists():
            json.loads((run / name).read_text())
    return current


def describe(run: Path, planned_stages: int = 3) -> str:
    """Where a killed fit stopped, read from what it left on disk."""
    if not run.is_dir():
        return "before the run directory"
    cache = run / "cache"
    leftovers = tmp_leftovers(cache)
    versions = FLCache(cache).versions()
    current = None
    if (cache / "CURRENT").is_file():
        current = json.loads((cache / "CURRENT").read_text())["version"]
    writing = [n for n in leftovers if not n.startswith(".CURRENT")]
    if writing:
        return f"during the write of cache version {writing[0][1:].split('.tmp-')[0]}"
    if any(n.startswith(".CURRENT") for n in leftovers):
        return "during the update of cache/CURRENT"
    if versions and versions[-1] != current:
        return f"after renaming {versions[-1]}, before CURRENT pointed to it"
    if current is None:
        return "before the first cache commit"
    stage = int(current.rsplit("-", 1)[1])
    if stage < planned_stages:
        return f"after committing stage {stage}"
    if not (run / "model.safetensors").exists():
        return "after the last commit, before model.safetensors"
    if not (run / "metrics.json").exists():
        return "after model.safetensors, before metrics.json"
    return "after metrics.json (shutting down)"


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    """``python -m fedshard_lightning ARGS`` in the repository root, output to ``log``.

    The child gets this process's intra-op thread count (tests/conftest.py sets 1): float32 results
    are bit-identical across processes only with the same number of threads (MKL splits reductions).
    """
    threads = str(torch.get_num_threads())
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "fedshard_lightning", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
        )


KILL_AT = Path(__file__).with_name("_kill_at.py")


@dataclass
class Kill:
    """A subprocess killed with SIGKILL once ``condition`` holds in ``run`` (see ``_kill_at.py``).

    The polling runs in a separate small process, so that a busy test process cannot delay it.
    """

    proc: subprocess.Popen
    run: Path
    condition: str
    delay: float = 0.0
    timeout: float = 300.0
    killed: bool = False
    seconds: float = 0.0
    returncode: int | None = None
    outcome: str = ""

    def watch(self) -> Kill:
        """Block until the watcher killed the process or saw it end; returns self."""
        start = time.monotonic()
        cmd = [sys.executable, "-I", "-S", str(KILL_AT), str(self.proc.pid), str(self.run), self.condition]
        cmd += ["--delay", str(self.delay), "--timeout", str(self.timeout)]
        try:
            watcher = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout + 60)
            self.outcome = watcher.stdout.strip() or watcher.stderr.strip()
        finally:
            if self.proc.poll() is None and self.outcome != "killed":
                self.proc.send_signal(signal.SIGKILL)
            self.returncode = self.proc.wait()
            self.seconds = time.monotonic() - start
        self.killed = self.outcome == "killed" and self.returncode == -signal.SIGKILL
        return self


def watch_all(kills: list[Kill]) -> list[Kill]:
    """Watch several killed subprocesses concurrently (they start up in parallel)."""
    threads = [threading.Thread(target=k.watch, daemon=True) for k in kills]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return kills


@dataclass
class Planned:
    """A subprocess to start and the moment (a ``_kill_at.py`` condition) to kill it at."""

    name: str
    args: list[str]
    run: Path
    moment: str


@dataclass
class Killed:
    """What a planned kill left: the run directory, the Kill and the process output."""

    run: Path
    kill: Kill
    log: str

    def check_killed(self) -> None:
        """Fail with the process output when the process ended before its moment."""
        assert self.kill.killed, (
            f"{self.run.name}: not killed at {self.kill.condition!r} (watcher: {self.kill.outcome!r}, exit "
            f"status {self.kill.returncode}):\n{self.log}"
        )


class Background:
    """Groups of killed subprocesses, started early and watched in threads while other tests run.

    Python start-up dominates a killed run, so starting every subprocess at the beginning of the
    session overlaps their start-up with the in-process tests.
    """

    def __init__(self) -> None:
        self._groups: dict[str, tuple[list[Planned], dict[str, Kill], list[threading.Thread], Path]] = {}

    def start(self, group: str, plans: list[Planned], logs: Path) -> None:
        """Spawn every planned subprocess of ``group`` and start watching them."""
        if group in self._groups:
            return
        kills, threads = {}, []
        for plan in plans:
            proc = spawn(plan.args, logs / f"{plan.name}.log")
            kill = Kill(proc, plan.run, plan.moment)
            kills[plan.name] = kill
            threads.append(threading.Thread(target=kill.watch, daemon=True))
            threads[-1].start()
        self._groups[group] = (plans, kills, threads, logs)

    def started(self, group: str) -> bool:
        """Whether ``group`` was started."""
        return group in self._groups

    def results(self, group: str) -> dict[str, Killed]:
        """Wait for every kill of ``group``; name -> what it left."""
        plans, kills, threads, logs = self._groups[group]
        for t in threads:
            t.join()
        return {
            p.name: Killed(p.run, kills[p.name], (logs / f"{p.name}.log").read_text(errors="replace"))
            for p in plans
        }

    def close(self) -> None:
        """Kill whatever still runs (an interrupted session)."""
        for _, kills, _, _ in self._groups.values():
            for k in kills.values():
                if k.proc.poll() is None:
                    k.proc.kill()
                    k.proc.wait()


def crash_plans(root: Path) -> list[Planned]:
    """Three fits of the tiny config, killed before the first commit, while version 2 is written, and
    right after the last commit."""
    moments = {
        # config.yaml is written once setup is done, about a second before the first commit.
        "before_first_commit": "file:config.yaml",
        "writing_version_2": "tmp:.0002-",
        "after_last_commit": "current:0003-",
    }
    return [
        Planned(
            name,
            ["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.run_name", name],
            root / name,
            m,
        )
        for name, m in moments.items()
    ]


UNLEARN_CLIENTS = "[2]"


def unlearn_plans(root: Path, reference_run: Path) -> list[Planned]:
    """Two ``unlearn --clients [2]`` on copies of the reference run: killed once the journal says
    'started' (still computing), and once CURRENT names the new version (reports not yet written)."""
    moments = {"after_started": "journal:started", "after_commit": "current:0004-"}
    plans = []
    for name, m in moments.items():
        run = copy_run(reference_run, root / name)
        args = ["unlearn", "--config", str(reference_run / "config.yaml"), "--ckpt_path", str(run)]
        plans.append(Planned(name, [*args, "--clients", UNLEARN_CLIENTS], run, m))
    return plans


def current_version(run: Path) -> str:
    """The version named by ``cache/CURRENT`` ('' while there is none)."""
    path = run / "cache" / "CURRENT"
    return json.loads(path.read_text())["version"] if path.is_file() else ""


def journal(run: Path) -> list[dict]:
    """Entries of ``unlearning/journal.jsonl`` (a torn last line is ignored)."""
    path = run / "unlearning" / "journal.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out
