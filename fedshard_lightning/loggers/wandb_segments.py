"""The offline W&B segments of a fit: a resumed fit replaces those of its interrupted runs.

Each process that logs to a run's W&B id writes one offline segment,
``RUN/wandb_files/wandb/offline-run-*``; ``wandb sync`` uploads the segments of one id in the
order they started and appends each to the run (their ``_step`` renumbered after the run's last).
A fit interrupted by Ctrl-C or SIGTERM has sent the rounds of the stage it had not committed,
which the resumed fit trains and logs again (the run would hold them twice); one killed by
SIGKILL may have written nothing at all (W&B flushes its ``.wandb`` file every 15 s and its
service stops with the process), so the committed stages would be missing. The CSV, written at
every commit, is the record of what the fit kept. So a resumed offline fit moves the segments
of its earlier fits to ``RUN/wandb_files/superseded/`` and logs the CSV's kept rows into its own
segment before its new rounds: the synced run then holds every round once, in order.

Segments already uploaded (a ``.synced`` marker, or an online run) cannot be taken back: then
the resumed fit rewinds the W&B run to its last kept row instead (:mod:`~.wandb_resume`).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from fedshard_lightning.flcache.io import atomic_write_json, read_json_object

__all__ = [
    "can_supersede",
    "close_stale_run",
    "close_wandb_run",
    "record_fit_segment",
    "remember_run",
    "supersede_fit_segments",
    "wandb_state",
    "write_wandb_state",
]

_OURS: set[str] = set()  # ids of the W&B runs this process opened for a run directory

_KEY = "fit_segments"


def wandb_state(run_dir: Path) -> dict[str, Any]:
    """``RUN/wandb.json``: the W&B run id (and the last logged step) of this run directory."""
    return read_json_object(run_dir / "wandb.json") or {}


def write_wandb_state(run_dir: Path, state: dict[str, Any]) -> None:
    """Replace ``RUN/wandb.json`` atomically (a crash leaves the old record, never half of one)."""
    atomic_write_json(run_dir / "wandb.json", state)


def supersede_fit_segments(run_dir: Path, mode: str) -> bool:
    """Move the earlier fits' offline segments out of the sync glob; whether the fit must replay the CSV.

    Called by a fit that resumes training, after its own segment was recorded (the last one, kept).
    Returns ``True`` when no earlier fit segment remains to be synced (none, or all moved), so the
    resumed fit's own segment must hold the whole kept history; ``False`` in online mode or when
    one was uploaded already (a ``.synced`` marker beside it, or an online run).
    """
    state = wandb_state(run_dir)
    names = [str(n) for n in state.get(_KEY, [])]
    earlier, own = names[:-1], names[-1:]
    root = run_dir / "wandb_files" / "wandb"
    if mode != "offline" or not can_supersede(run_dir, earlier):
        return False
    target = run_dir / "wandb_files" / "superseded"
    for name in earlier:
        if (root / name).is_dir():
            target.mkdir(parents=True, exist_ok=True)
            shutil.move(str(root / name), str(target / name))
    if earlier:
        state[_KEY] = own
        write_wandb_state(run_dir, state)
    return True


def can_supersede(run_dir: Path, earlier: list[str]) -> bool:
    """Whether none of these fit segments was uploaded: each offline and without wandb sync's ``.synced`` marker."""
    root = run_dir / "wandb_files" / "wandb"
    return not any(
        not n.startswith("offline-run-") or any((root / n).glob("*.wandb.synced")) for n in map(str, earlier)
    )


def record_fit_segment(run_dir: Path, logger: Any) -> None:
    """Remember the segment this fit's W&B run writes (``offline-run-*``, or ``run-*`` online)."""
    run = logger.experiment
    folder = Path(str(getattr(run, "dir", "") or "")).parent
    if not folder.name:
        return
    state = wandb_state(run_dir)
    state[_KEY] = [*state.get(_KEY, []), folder.name]
    write_wandb_state(run_dir, state)


def close_wandb_run(wandb: bool) -> None:
    """Finish the open W&B run of a stopped fit as failed, so a resume in this process writes a new segment.

    A process that exits finishes it at exit; one that goes on (a notebook) would otherwise have
    the resumed fit log into the stopped fit's segment, which the resume supersedes.
    """
    if wandb:
        import wandb as wandb_module

        if wandb_module.run is not None:
            wandb_module.finish(exit_code=1)


def remember_run(run_id: str) -> None:
    """Note a W&B run opened for a run directory, so that :func:`close_stale_run` may close it."""
    _OURS.add(run_id)


def close_stale_run() -> None:
    """Finish a W&B run that an earlier command in this process left open (it failed, or had nothing to do).

    Lightning's ``WandbLogger`` logs into any open run: the next command, on another run
    directory, would write its rows into that run. A run the user opened (a sweep's) is left alone.
    """
    wandb_module = sys.modules.get("wandb")
    run = getattr(wandb_module, "run", None)
    if run is not None and run.id in _OURS:
        wandb_module.finish()
