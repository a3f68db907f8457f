"""Crash trials of ``unlearn``: SIGKILL it at random moments, re-run it, then check that every reader agrees.

One finished fit of the tiny digits config (8 clients, 3 stages, in-process) is the base. Its
uninterrupted ``unlearn --clients [2]`` and then ``[5]`` (in-process, on copies) give the reference
models. Each trial copies the base, starts ``python -m fedshard_lightning unlearn --clients [2]``
and kills it with SIGKILL either a random delay after the journal says ``started`` (up to 1.1 times
the reference's time from ``started`` to ``committed``) or at a random
write event (journal started, the new version's blobs being written, CURRENT naming it,
model.safetensors replaced, the request report, unlearn_report.json, journal committed). Then:

1. the run must be consistent (every version verified) and ``test`` must leave a
   ``model.safetensors`` equal to the cache's current model (else: a stale model);
2. ``unlearn --clients [2]`` again (resumable) must give the reference model byte for byte;
3. ``test`` (stale check again), ``unlearn --clients [5]`` (bit-identical to the reference) and
   ``audit`` (passes, leaves the model alone) must agree on one model.

Prints one line per trial and the figures: kills, resumable, bit-identical, stale models (must be 0).

Usage::

    python scripts/crash_unlearn.py --trials 30 --seed 0 [--workdir DIR]
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

from _agree import Agreement, agree, model_matches_cache
from _reliability_helpers import TINY, Kill, check_consistent, cli, copy_run, current_version, journal, spawn

#: Write events a trial may be killed at (conditions of tests/reliability/_kill_at.py).
EVENTS = {
    "journal started": "journal:started",
    "blobs of the new version": "tmp:.0004-",
    "CURRENT names the new version": "current:0004-",
    "model.safetensors replaced": "changed:model.safetensors",
    "request report written": "file:unlearning/0001/report.json",
    "unlearn_report.json written": "file:unlearn_report.json",
    "journal committed": "journal:committed",
}
FIRST, SECOND = "[2]", "[5]"


@dataclass
class Trial:
    """One killed unlearn and what followed."""

    number: int
    run: Path
    mode: str = ""
    killed: bool = False
    where: str = ""
    consistent: str = ""
    stale_after_kill: bool = False
    rerun: str = ""
    identical: bool = False
    agreement: Agreement = field(default_factory=Agreement)


def unlearn_args(run: Path, clients: str) -> list[str]:
    """``unlearn`` of the run with its own config."""
    return ["unlearn", "--config", str(run / "config.yaml"), "--ckpt_path", str(run), "--clients", clients]


def where(run: Path) -> str:
    """Where the killed unlearn stopped, read from what it left."""
    events = [e.get("event") for e in journal(run)]
    version = current_version(run)
    if "committed" in events:
        return "after the journal's committed line"
    if version.startswith("0004-"):
        if (run / "unlearn_report.json").is_file():
            return "after unlearn_report.json, before the journal's committed line"
        if (run / "unlearning" / "0001" / "report.json").is_file():
            return "after the request report, before unlearn_report.json"
        return "after CURRENT named the new version, before the reports"
    if any(p.name.startswith(".0004-") for p in (run / "cache").iterdir()):
        return "while the new version was written"
    if "started" in events:
        return "after the journal's started line, before the commit"
    return "before the journal's started line"


def references(root: Path) -> tuple[Path, bytes, bytes, float]:
    """The base run, the reference models after [2] and after [2] then [5], and the span of a subprocess unlearn."""
    code, _, err = cli(["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.run_name", "base"])
    if code != 0:
        raise SystemExit(f"the base fit failed:\n{err}")
    base = root / "base"
    ref = copy_run(base, root / "reference")
    for clients in (FIRST, SECOND):
        code, _, err = cli(unlearn_args(ref, clients))
        if code != 0:
            raise SystemExit(f"the reference unlearn {clients} failed:\n{err}")
        if clients == FIRST:
            first = (ref / "model.safetensors").read_bytes()
    second = (ref / "model.safetensors").read_bytes()
    timed = copy_run(base, root / "timed")
    proc = spawn(unlearn_args(timed, FIRST), root / "timed.log")
    started = committed = None
    while proc.poll() is None:
        events = [e.get("event") for e in journal(timed)]
        if started is None and "started" in events:
            started = time.monotonic()
        if committed is None and "committed" in events:
            committed = time.monotonic()
        time.sleep(0.001)
    if proc.returncode != 0 or (timed / "model.safetensors").read_bytes() != first or started is None:
        raise SystemExit(
            f"the timed subprocess unlearn failed or differs:\n{(root / 'timed.log').read_text()}"
        )
    return base, first, second, (committed or time.monotonic()) - started


def run_trial(trial: Trial, base: Path, rng: random.Random, span: float, first: bytes, second: bytes) -> None:
    """Kill one unlearn, then check, re-run and compare."""
    copy_run(base, trial.run)
    proc = spawn(unlearn_args(trial.run, FIRST), trial.run.parent / f"{trial.run.name}.log")
    if rng.random() < 0.5:
        delay = rng.uniform(0.0, span * 1.1)
        trial.mode = f"{delay:5.3f}s after started"
        kill = Kill(proc, trial.run, "journal:started", delay=delay)
    else:
        event = rng.choice(sorted(EVENTS))
        trial.mode = f"at: {event}"
        kill = Kill(proc, trial.run, EVENTS[event])
    kill.watch()
    trial.killed = kill.killed
    trial.where = where(trial.run) if kill.killed else f"finished first (exit {kill.returncode})"
    try:
        check_consistent(trial.run)
        trial.consistent = "yes"
    except Exception as e:
        trial.consistent = f"NO: {e}"
    config = ["--config", str(trial.run / "config.yaml"), "--ckpt_path", str(trial.run)]
    code, _, _ = cli(["test", *config])
    trial.stale_after_kill = code != 0 or not model_matches_cache(trial.run)
    code, _, err = cli(unlearn_args(trial.run, FIRST))
    trial.rerun = "ok" if code == 0 else f"exit {code}: {err.strip().splitlines()[-1:]}"
    trial.identical = code == 0 and (trial.run / "model.safetensors").read_bytes() == first
    trial.agreement = agree(trial.run, trial.run / "config.yaml", SECOND, second)


def main(argv: list[str] | None = None) -> int:
    """Run the trials and print the figures; exit status 1 on any stale, differing or refused run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30, help="number of killed unlearns (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default 0)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="folder for the runs (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be >= 1")
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # the subprocesses get the same count: float32 bits depend on it
    root = args.workdir or Path(tempfile.mkdtemp(prefix="crash-unlearn-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t = time.monotonic()
    base, first, second, span = references(root)
    print(
        f"reference unlearn: {span:.3f}s from the journal's started line to its committed line ({root})",
        flush=True,
    )
    trials = [Trial(i, root / f"trial_{i:03d}") for i in range(args.trials)]
    for trial in trials:
        run_trial(trial, base, rng, span, first, second)
        a = trial.agreement
        print(
            f"trial {trial.number:3d}  {trial.mode:40s}  {trial.where:58s}  consistent {trial.consistent}  "
            f"stale {'YES' if trial.stale_after_kill or a.stale else 'no'}  re-run {trial.rerun}  "
            f"bit-identical {'yes' if trial.identical else 'NO'}  then test {a.test}, unlearn {a.unlearn} "
            f"({'identical' if a.identical else 'DIFFERS'}), audit {a.audit}",
            flush=True,
        )
        if trial.consistent == "yes":
            shutil.rmtree(trial.run, ignore_errors=True)
    n = len(trials)
    kills = sum(t.killed for t in trials)
    resumable = sum(t.rerun == "ok" for t in trials)
    identical = sum(t.identical and t.agreement.identical for t in trials)
    stale = sum(t.stale_after_kill or t.agreement.stale for t in trials)
    agreed = sum(t.agreement.ok and not t.stale_after_kill for t in trials)
    print("\nwhere the kills landed")
    for place, count in sorted(collections.Counter(t.where for t in trials).items()):
        print(f"  {count:3d}  {place}")
    print(
        f"figures: unlearn kills {kills}/{n}, consistent {sum(t.consistent == 'yes' for t in trials)}/{n}, "
        f"resumable {resumable}/{n}, bit-identical {identical}/{n}, stale models {stale}, "
        f"test+unlearn+audit agree {agreed}/{n}; wall time {time.monotonic() - t:.0f}s"
    )
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if stale == 0 and agreed == n and identical == n else 1


if __name__ == "__main__":
    raise SystemExit(main())
