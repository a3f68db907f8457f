"""Crash trials: SIGKILL ``python -m fedshard_lightning fit`` at random moments, resume, compare bytes.

One uninterrupted subprocess fit of the tiny digits config (8 clients, 3 stages) gives the reference
model and the time span from the moment its run directory appears to its exit. Each trial starts
the same fit and kills it with SIGKILL either after a random delay within that span (measured from
the appearance of its run directory) or at a random write event (a cache version's temporary
folder appearing, CURRENT naming a version, model.safetensors appearing). Each killed run directory
is checked for consistency (``FLCache.current()`` and ``verify()`` of every version whenever
``CURRENT`` exists), resumed in-process with ``fit --ckpt_path RUN_DIR``, and its final
model.safetensors compared byte for byte with the reference. Then ``test`` (the model must equal
the cache's current model: else it is stale), ``unlearn --clients [2]`` (byte for byte the
reference's unlearned model) and ``audit`` (passes, leaves the model alone) must agree on one
model. Prints one line per trial and a tally: kills, resumable, bit-identical, stale models.
``scripts/crash_unlearn.py`` kills ``unlearn`` the same way.

Usage::

    python scripts/crash_trials.py --trials 20 --seed 0 [--jobs 2] [--workdir DIR]
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

import torch
from _agree import Agreement, agree
from _reliability_helpers import (
    TINY,
    Kill,
    check_consistent,
    cli,
    copy_run,
    describe,
    error_lines,
    spawn,
    tmp_leftovers,
    watch_all,
)

#: Write events a trial may be killed at (conditions of tests/reliability/_kill_at.py).
EVENTS = {
    **{f"writing version {k}": f"tmp:.000{k}-" for k in (1, 2, 3)},
    **{f"CURRENT names version {k}": f"current:000{k}-" for k in (1, 2, 3)},
    "model.safetensors appears": "file:model.safetensors",
}


@dataclass
class Trial:
    """One killed and resumed fit."""

    number: int
    mode: str
    run: Path
    stage: str = ""
    consistent: str = ""
    resume: str = ""
    identical: str = ""
    killed: bool = False
    agreement: Agreement | None = None


def fit_args(root: Path, name: str) -> list[str]:
    """The tiny fit, in ``root/name``."""
    return ["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.run_name", name]


def reference(root: Path) -> tuple[bytes, float, bytes]:
    """The uninterrupted fit's model bytes, its span from run directory to metrics.json, its model after unlearn.

    The last is the model bytes after an uninterrupted ``unlearn --clients [2]`` of a copy.
    """
    run = root / "reference"
    proc = spawn(fit_args(root, "reference"), root / "reference.log")
    appeared = done = None
    while proc.poll() is None:
        now = time.monotonic()
        if appeared is None and run.is_dir():
            appeared = now
        if done is None and (run / "metrics.json").is_file():
            done = now
        time.sleep(0.001)
    if proc.returncode != 0 or appeared is None:
        raise SystemExit(f"the reference fit failed:\n{(root / 'reference.log').read_text(errors='replace')}")
    unlearned = copy_run(run, root / "reference_unlearned")
    code, _, err = cli(["unlearn", "--ckpt_path", str(unlearned), "--clients", UNLEARN])
    if code != 0:
        raise SystemExit(f"the reference unlearn failed:\n{err}")
    span = (done or time.monotonic()) - appeared
    return (run / "model.safetensors").read_bytes(), span, (unlearned / "model.safetensors").read_bytes()


UNLEARN = "[2]"


def plan(trial: Trial, rng: random.Random, span: float) -> Kill:
    """Spawn the trial's fit and the Kill that ends it."""
    proc = spawn(fit_args(trial.run.parent, trial.run.name), trial.run.parent / f"{trial.run.name}.log")
    if rng.random() < 2 / 3:
        delay = rng.uniform(0.0, span * 1.1)
        trial.mode = f"{delay:5.2f}s after the run dir"
        return Kill(proc, trial.run, "dir", delay=delay)
    event = rng.choice(sorted(EVENTS))
    trial.mode = f"at: {event}"
    return Kill(proc, trial.run, EVENTS[event])


def inspect(trial: Trial, kill: Kill) -> None:
    """Describe what the kill left and check that it is consistent."""
    trial.killed = kill.killed
    trial.stage = (
        describe(trial.run) if trial.killed else f"finished before the kill (exit {kill.returncode})"
    )
    try:
        check_consistent(trial.run)
        trial.consistent = "yes"
    except Exception as e:
        trial.consistent = f"NO: {e}"


def resume(trial: Trial, model: bytes, unlearned: bytes) -> None:
    """``fit --ckpt_path RUN_DIR`` in-process, as a user resumes (no flags: the run's own config); compare models.

    Without flags, a resume that fell back to the package defaults trains another model: it
    counts as silently wrong (not bit-identical), never as a success.
    """
    code, _, err = cli(["fit", "--ckpt_path", str(trial.run)])
    if code != 0:
        lines = error_lines(err)
        reason = lines[-1] if lines else f"exit status {code}"
        trial.resume = f"refused: {reason.replace(str(trial.run), 'RUN_DIR')}"
        trial.identical = "-"
        return
    leftovers = tmp_leftovers(trial.run / "cache") + tmp_leftovers(trial.run)
    trial.resume = "ok" if not leftovers else f"ok, leftovers {leftovers}"
    same = (trial.run / "model.safetensors").read_bytes() == model
    trial.identical = "yes" if same else "NO"
    trial.agreement = agree(trial.run, trial.run / "config.yaml", UNLEARN, unlearned)


def main(argv: list[str] | None = None) -> int:
    """Run the trials and print the tally; exit status 1 if a run was corrupt or differs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="number of killed fits (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default 0)")
    parser.add_argument("--jobs", type=int, default=2, help="fits started together (default 2)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="folder for the runs (default: a temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # the subprocesses get the same count: float32 bits depend on it
    if args.trials < 1 or args.jobs < 1:
        parser.error("--trials and --jobs must be >= 1")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="crash-trials-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t = time.monotonic()
    model, span, unlearned = reference(root)
    print(f"reference fit: {span:.2f}s from its run directory to metrics.json ({root})", flush=True)
    trials = [Trial(i, "", root / f"trial_{i:03d}") for i in range(args.trials)]
    for start in range(0, len(trials), args.jobs):
        batch = trials[start : start + args.jobs]
        kills = [plan(trial, rng, span) for trial in batch]
        watch_all(kills)
        for trial, kill in zip(batch, kills):
            inspect(trial, kill)
    for trial in trials:
        resume(trial, model, unlearned)
        a = trial.agreement
        after = (
            ""
            if a is None
            else (
                f"  then test {a.test} (stale {'YES' if a.stale else 'no'}), unlearn {a.unlearn} "
                f"({'identical' if a.identical else 'DIFFERS'}), audit {a.audit}"
            )
        )
        print(
            f"trial {trial.number:3d}  {trial.mode:32s}  {trial.stage:52s}  "
            f"consistent {trial.consistent}  resume {trial.resume}  bit-identical {trial.identical}{after}",
            flush=True,
        )
    print("\ntally")
    for stage, n in sorted(collections.Counter(t.stage for t in trials).items()):
        print(f"  {n:3d}  {stage}")
    consistent = sum(t.consistent == "yes" for t in trials)
    resumed = sum(t.resume.startswith("ok") for t in trials)
    identical = sum(t.identical == "yes" for t in trials)
    print(f"  consistent after the kill: {consistent}/{len(trials)}")
    print(f"  resumed ok: {resumed}/{len(trials)}")
    print(f"  bit-identical to the uninterrupted run: {identical}/{resumed} resumed")
    for reason, n in collections.Counter(t.resume for t in trials if not t.resume.startswith("ok")).items():
        print(f"  {n:3d}  resume {reason}")
    # A refusal must say how to go on: removing the folder (then a new run), never only "start a new run",
    # which a new run of the same name answers with "resume it".
    dead = sum(t.resume.startswith("refused") and "rm -r" not in t.resume for t in trials)
    wrong = sum(t.identical == "NO" for t in trials)
    checked = [t.agreement for t in trials if t.agreement is not None]
    stale = sum(a.stale for a in checked)
    agreed = sum(a.ok for a in checked)
    print(
        f"figures: fit kills {sum(t.killed for t in trials)}/{len(trials)}, resumable {resumed}/{len(trials)}, "
        f"bit-identical {identical}/{len(trials)}, silently wrong {wrong}, dead ends {dead}, stale models {stale}, "
        f"test+unlearn+audit agree {agreed}/{len(checked)}"
    )
    print(f"  wall time {time.monotonic() - t:.0f}s")
    if not args.keep and args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    bad = consistent < len(trials) or wrong or dead or stale or agreed < len(checked)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
