"""The run's record of unlearning requests and its current cache version must agree: no silent rollback.

A request leaves three records: its entry in the cache's request log (the manifest), its report
``unlearning/NNNN/report.json`` and the journal's ``committed`` line; the reports and the journal
are written after the commit, so they may lag the cache (a crash; the next load re-creates them)
but never lead it. Pointing ``CURRENT`` back to a version before a request, or editing a
manifest's ``unlearned`` list (and rehashing ``CURRENT``), would bring an unlearned client's data
back into the deployed model without a word; :func:`check_history` refuses every such
disagreement in one line before anything is loaded into a model or written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.io import read_json_object
from fedshard_lightning.flcache.reader import CacheReader
from fedshard_lightning.run.directory import Journal

__all__ = ["check_history", "recorded_requests"]

_FIX = "restore the run directory from a backup (or unlearn the clients again into a copy of it)"


def _clients(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        return sorted(value)
    return None


def _number(version: Any) -> int:
    head = str(version).split("-", 1)[0]
    return int(head) if head.isdigit() else -1


def _record(entry: dict[str, Any], where: Path) -> dict[str, Any]:
    return {
        "clients": _clients(entry.get("clients")),
        "cache_version": entry.get("cache_version"),
        "where": str(where),
    }


def recorded_requests(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """Requests the run directory records outside the cache: ``(number, {clients, cache_version, where})``.

    From the journal's ``committed`` lines and the per-request reports, each on its own (a report
    edited to name other clients disagrees with the cache even while the journal is intact); damaged
    entries are skipped (the cache's own log is checked against the manifest instead).
    """
    found: list[tuple[int, dict[str, Any]]] = []
    journal = Journal(run_dir)
    for number, entry in journal.committed_entries().items():
        found.append((number, _record(entry, journal.path)))
    folder = run_dir / "unlearning"
    if folder.is_dir():
        for sub in sorted(folder.iterdir()):
            if sub.name.isdigit() and len(sub.name) == 4:
                found.append(
                    (int(sub.name), _record(read_json_object(sub / "report.json") or {}, sub / "report.json"))
                )
    return [(number, record) for number, record in found if record["clients"] is not None]


def check_history(run_dir: Path, cache: CacheReader, manifest: dict[str, Any] | None = None) -> None:
    """Refuse a current version that the request records disagree with (see the module docstring).

    Args:
        run_dir: The run directory.
        cache: Its FLCache.
        manifest: The current version's manifest when the caller holds it already.

    Raises:
        CacheError: One line naming the request, the record and the version.
    """
    version = cache.current()
    manifest = manifest if manifest is not None else cache.manifest(version)
    log = manifest.get("requests", [])
    unlearned = set(manifest.get("unlearned", []))
    where = f"{cache.root / version}/manifest.json"
    for i, entry in enumerate(log, start=1):
        clients = _clients(entry.get("clients")) if isinstance(entry, dict) else None
        if clients is None or not set(clients) <= unlearned:
            raise CacheError(
                f"{where}: its request log holds request {i} (clients {clients}) but its unlearned clients "
                f"{sorted(unlearned)} miss them: the manifest was edited; {_FIX}"
            )
    for number, record in sorted(recorded_requests(run_dir), key=lambda r: (r[0], r[1]["where"])):
        clients, at = record["clients"], record["cache_version"]
        if number > len(log) or _clients(log[number - 1].get("clients")) != clients:
            raise CacheError(
                f"{record['where']} records unlearning request {number} (clients {clients}), but the current "
                f"cache version {version} holds {len(log)} request(s): CURRENT was rolled back or the cache "
                f"replaced, which would bring those clients' data back; {_FIX}"
            )
        if not set(clients) <= unlearned:
            raise CacheError(
                f"{record['where']} records clients {clients} as unlearned, but the current cache version "
                f"{version} has unlearned {sorted(unlearned)}: the manifest was edited; {_FIX}"
            )
        if at is not None and _number(at) > _number(version):
            raise CacheError(
                f"{record['where']} records request {number} in cache version {at}, newer than the current "
                f"{version}: CURRENT was rolled back; {_FIX}"
            )
