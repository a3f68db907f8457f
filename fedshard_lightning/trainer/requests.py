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

from fedshard_lightning.callbacks.progress import format_rate, format_seconds
from fedshard_lightning.errors import UnlearningRequestError
from fedshard_lightning.unlearning.base import UnlearnResult

__all__ = [
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
