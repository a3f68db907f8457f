"""Unlearning requests: checking the client ids, spotting repeats, and the report of one request.

The trainer's ``unlearn`` runs :func:`check_request` before anything is journaled, then the
algorithm's pure :meth:`~fedshard_lightning.unlearning.base.Algorithm.what_if`, then
:func:`request_report` for the file that the request leaves in ``unlearning/NNNN/report.json``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fedshard_lightning.callbacks.dispatch import call_hook
from fedshard_lightning.callbacks.metrics_logger import request_row
from fedshard_lightning.callbacks.progress import format_rate, format_seconds
from fedshard_lightning.errors import UnlearningRequestError
from fedshard_lightning.flcache.io import atomic_write_json
from fedshard_lightning.loggers.run_loggers import finish_loggers, logged_requests
from fedshard_lightning.run.directory import Journal
from fedshard_lightning.unlearning.base import UnlearnResult
from fedshard_lightning.unlearning.contract import check_cost

__all__ = [
    "apply_request",
    "check_request",
    "request_report",
    "request_start_line",
    "validate_clients",
    "validate_exclude",
]


def validate_clients(clients: Any, num_clients: int, field: str = "clients") -> list[int]:
    """Sorted client ids (one id alone: ``--clients 7``), refused in one line when malformed, unknown or repeated."""
    if isinstance(clients, int) and not isinstance(clients, bool):
        clients = [clients]
    if isinstance(clients, (int, str)) or clients is None:
        raise UnlearningRequestError(
            f"{field}={clients!r}: give a list of client ids, e.g. --{field} '[3, 17]'"
        )
    ids = list(clients)
    if not ids:
        raise UnlearningRequestError(f"{field}=[]: name at least one client id to unlearn")
    k = num_clients
    for c in ids:
        if isinstance(c, bool) or not isinstance(c, int):
            raise UnlearningRequestError(
                f"{field}: {c!r} is not an integer client id (valid ids: 0..{k - 1})"
            )
        if not 0 <= c < k:
            raise UnlearningRequestError(f"{field}: unknown client id {c} (valid ids: 0..{k - 1})")
    dups = sorted(c for c, n in Counter(ids).items() if n > 1)  # linear: K may be thousands
    if dups:
        raise UnlearningRequestError(f"{field}: duplicate ids {dups}; name each client once")
    return sorted(ids)


def validate_exclude(clients: Any, num_clients: int) -> list[int]:
    """``fit --exclude_clients``: the ids ``unlearn`` would take, and at least one client left to train.

    An unknown id had been ignored (the fit trained every client) and excluding all of them had
    trained nobody, both with exit status 0.
    """
    if not clients:
        return []
    ids = validate_clients(clients, num_clients, field="exclude_clients")
    if len(ids) == num_clients:
        raise UnlearningRequestError(
            f"exclude_clients: excludes every client ({num_clients}); leave at least one to train"
        )
    return ids


def check_request(
    ids: list[int], unlearned: Sequence[int], requests: Sequence[dict[str, Any]], num_clients: int
) -> tuple[dict[str, Any] | None, str]:
    """(the no-op answer and its message when every id was unlearned already, else ``(None, "")``).

    Raises:
        UnlearningRequestError: Some but not all ids were unlearned before, or nobody would remain.
    """
    done = set(unlearned)
    if set(ids) <= done:
        for i, req in enumerate(requests, start=1):
            if sorted(req["clients"]) == ids:
                msg = f"unlearn: clients {ids} were already unlearned by request {i:04d}; nothing to do"
                return {**req, "already_applied": True}, msg
        return {
            "clients": ids,
            "already_applied": True,
        }, f"unlearn: clients {ids} were already unlearned; nothing to do"
    again = sorted(set(ids) & done)
    if again:
        raise UnlearningRequestError(
            f"clients: {again} were already unlearned by an earlier request; leave them out"
        )
    if not set(range(num_clients)) - done - set(ids):
        raise UnlearningRequestError(
            "clients: the request would unlearn every remaining client; keep at least one"
        )
    return None, ""


def request_report(
    number: int,
    ids: list[int],
    algorithm: str,
    result: UnlearnResult,
    predicted: int,
    retrain: int,
    before: tuple[float, float],
    after: tuple[float, float],
) -> dict[str, Any]:
    """The report of one applied request (costs, accuracy before and after, the algorithm's details)."""
    return {
        "request": number,
        "clients": ids,
        "algorithm": algorithm,
        "client_steps": int(result.client_steps),
        "predicted_client_steps": int(predicted),
        "retrain_client_steps": int(retrain),
        "speedup_client_steps": (retrain / result.client_steps) if result.client_steps else float("inf"),
        "seconds": result.seconds,
        "server_seconds": result.server_seconds,
        "test_accuracy_before": before[0],
        "test_accuracy_after": after[0],
        "test_loss_before": before[1],
        "test_loss_after": after[1],
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **result.details,
    }


def request_start_line(run_dir: Path, number: int, ids: list[int], predicted: int, retrain: int) -> str:
    """The line printed before a request runs: its predicted cost and an ETA at the fit's measured speed."""
    line = f"unlearn: request {number:04d}, clients {ids}: {predicted} client-steps predicted (retraining: {retrain})"
    try:
        fit = json.loads((run_dir / "metrics.json").read_text())
        rate = float(fit["client_steps"]) / float(fit["seconds"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return line
    return f"{line} · ETA ~{format_seconds(predicted / rate)} at the fit's {format_rate(rate)} client-steps/s"


def log_lost_requests(trainer: Any) -> int:
    """Log the rows of committed requests whose process was killed before logging them; how many.

    Each takes the next step, in request order, so the rows stay in the order of the requests.
    """
    if not trainer.is_global_zero:
        return 0
    logged = logged_requests(trainer.run_dir)
    lost = [r for r in trainer.store.requests if int(r.get("request", 0)) not in logged]
    for report in lost:
        trainer.reporter.log(request_row(report), step=trainer.log_step_start)
        trainer.log_step_start += 1
    return len(lost)


def apply_request(trainer: Any, clients: Any) -> dict[str, Any]:
    """One request on a loaded run (the caller holds the run lock): check, journal, unlearn, commit, report.

    The new state comes from the algorithm's pure ``what_if``; it becomes the algorithm's state
    and is committed as one cache version before the model file, the report and the journal's
    ``committed`` line are written (a crash in between is repaired by the next load).
    """
    alg, store = trainer.algorithm, trainer.store
    ids = validate_clients(clients, alg.num_clients)
    noop, message = check_request(ids, alg.unlearned, store.requests, alg.num_clients)
    log_lost_requests(trainer)
    if noop is not None:  # close the loggers (and the W&B run) whether or not a late row was logged
        finish_loggers(trainer.fabric.loggers, trainer.wandb, trainer.run_dir, trainer.log_step_start)
        trainer._print(message)
        return noop
    number = len(store.requests) + 1
    journal = Journal(trainer.run_dir, enabled=trainer.is_global_zero)
    journal.append({"event": "started", "request": number, "clients": ids})
    call_hook(trainer.fabric, "on_unlearn_start", trainer.view(), clients=ids)
    before = trainer.evaluate(alg.current_params())
    predicted = check_cost(alg, alg.predict_cost(ids), "predict_cost()")
    retrain = check_cost(alg, alg.retrain_cost(ids), "retrain_cost()")
    trainer._print(request_start_line(trainer.run_dir, number, ids, predicted, retrain))
    state, result = alg.what_if(alg.state_dict(), ids)
    alg.load_state_dict(state)
    report = request_report(
        number, ids, alg.name, result, predicted, retrain, before, trainer.evaluate(result.params)
    )
    store.requests.append(report)
    if trainer.is_global_zero:
        report["cache_version"] = store.commit(alg, f"unlearn-{number:04d}", True, alg.engine.mode)
        call_hook(
            trainer.fabric,
            "on_commit",
            trainer.view(),
            version=report["cache_version"],
            label=f"unlearn-{number:04d}",
        )
        try:
            _write_request_files(trainer, journal, number, ids, result.params, report)
        except OSError as e:  # the request is in the cache: its one line must not ask to redo it
            e.committed_request = number
            raise
    call_hook(trainer.fabric, "on_unlearn_end", trainer.view(), report=report)
    finish_loggers(trainer.fabric.loggers, trainer.wandb, trainer.run_dir, trainer.log_step_start + 1)
    trainer._print(
        f"unlearn: clients {ids} removed with {report['client_steps']} client-steps "
        f"(retraining: {report['retrain_client_steps']}, {report['speedup_client_steps']:.2f}x), "
        f"{report['seconds']:.2f}s; test_accuracy {before[0]:.4f} -> {report['test_accuracy_after']:.4f}; "
        f"report: {trainer.run_dir / 'unlearn_report.json'}"
    )
    return report


def _write_request_files(
    trainer: Any, journal: Journal, number: int, ids: list[int], params: Any, report: dict[str, Any]
) -> None:
    """After the commit: the model, the reports and the journal's line (the next load repairs any of them)."""
    trainer._write_model(params)
    rdir = trainer.run_dir / "unlearning" / f"{number:04d}"
    rdir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(rdir / "report.json", report)
    atomic_write_json(trainer.run_dir / "unlearn_report.json", report)
    journal.append(
        {"event": "committed", "request": number, "clients": ids, "cache_version": report["cache_version"]}
    )
