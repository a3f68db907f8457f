"""How a resumed fit opens its W&B run, so that the run's history ends up equal to ``logs/metrics.csv``.

A resumed fit keeps the CSV rows of the stages its interrupted runs committed and trains the rest
again. Its W&B run is opened only once the resume was accepted (a refused one opens nothing) and
then in one of four ways:

- the fit was complete and its W&B run was finished with its final row (``RUN/wandb.json``'s step
  is past it): nothing is trained, so nothing is logged to W&B (its history has every row already);
- no earlier fit segment uploaded (none, or offline ones not synced yet), online or offline: the
  earlier segments are superseded and the CSV's kept rows are replayed into the new segment or
  online run (:func:`~.wandb_segments.supersede_fit_segments`); the server has none of them, so
  there is nothing to rewind (and ``RewindRun`` on a run the server lacks would fail);
- otherwise (an earlier segment was online or synced already) the run is *rewound* to the W&B step of
  the last kept row: ``wandb.init(resume_from="ID?_step=N")``. W&B then truncates the history after
  step ``N`` and logs the new rows from ``N + 1``. Online this happens at ``wandb.init``; offline the
  segment's run record carries the branch point and ``wandb sync`` rewinds when it uploads it.
  A W&B step is one ``log`` call, and every CSV row is one, so the ``N + 1`` kept rows are steps ``0..N``;
- no stage was committed (nothing kept): W&B cannot rewind to before step 0, so the run is resumed
  as before and keeps the interrupted stage's rows.

Checked with wandb 0.31 without a server: the arguments given to ``wandb.init``, the branch point in
the offline segment's run record and its rows' ``_step``, and (against a local stand-in server) that
``wandb.init`` sends the ``RewindRun`` mutation with that step before anything else and then streams
the rows from ``N + 1``. Not checked: the server's truncation itself (W&B calls rewind a beta
feature), and a run whose W&B history lacks rows the CSV kept (an online fit killed by SIGKILL
before W&B sent them): its step numbers then no longer match the CSV's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedshard_lightning.loggers.run_loggers import _resume_step
from fedshard_lightning.loggers.wandb_segments import (
    can_supersede,
    record_fit_segment,
    supersede_fit_segments,
    wandb_state,
)

__all__ = ["committed_rows", "open_resumed_fit_run", "rewind_init_args"]


def committed_rows(rows: list[dict[str, str]]) -> tuple[int, int]:
    """(CSV rows a resumed fit keeps, the step after them): those up to the last stage summary."""
    step = _resume_step(rows)
    return sum(1 for r in rows if r.get("step") not in ("", None) and int(float(r["step"])) < step), step


def rewind_init_args(init: dict[str, Any], run_id: str, step: int) -> None:
    """Make ``wandb.init``'s arguments rewind run ``run_id`` to ``_step == step`` (``resume`` excludes it)."""
    init.pop("resume", None)
    init["resume_from"] = f"{run_id}?_step={step}"


def open_resumed_fit_run(
    logger: Any,
    csv_history: list[dict[str, str]],
    hparams: dict[str, Any],
    run_dir: Path,
    resumed: bool,
    finished: bool,
) -> tuple[bool, bool]:
    """Open ``logger``'s W&B run for a fit started with ``ckpt_path``: (keep the logger, replay the CSV's kept rows into it).

    ``resumed``: the restored state is trained on (else the fit starts over and its W&B run is
    resumed as before). ``finished``: the restored state was complete. The logger is not kept
    when its run already holds every row.
    """
    kept, next_step = committed_rows(csv_history)
    state = wandb_state(run_dir)
    if resumed and finished and int(state.get("step", 0)) > next_step:  # its final row is there
        return False, False
    # No earlier fit segment uploaded (none, or offline ones not synced): the server has none of
    # its rows, so nothing can be rewound; the kept rows are replayed (online too) instead.
    replay = resumed and can_supersede(run_dir, [*state.get("fit_segments", [])])
    if resumed and not replay and kept > 0:
        rewind_init_args(logger._wandb_init, str(state["id"]), kept - 1)
    logger.log_hyperparams(hparams)  # opens the run
    record_fit_segment(run_dir, logger)
    # The earlier segments are offline whatever this fit's mode: they leave the sync glob.
    return True, replay and supersede_fit_segments(run_dir, "offline")
