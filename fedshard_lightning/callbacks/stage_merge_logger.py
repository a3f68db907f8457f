"""Records FedShard's merge decisions (A1) and round allocations (A2): how the shard tree grows."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.view import RunView

__all__ = ["StageMergeLogger"]


class StageMergeLogger(FederatedCallback):
    """Writes one JSON line per merge to ``run_dir/merges.jsonl`` and scalars to the loggers.

    Each line holds the stage, the grouping (children indices of stage ``p - 1`` per new shard),
    the clients of every new shard (when the algorithm exposes its tree), the children's alphas
    (the signed angles of the stage ``p - 1`` shards that A1 balanced), each group's mean alpha
    (what A1 tries to bring to zero), and the rounds A2 gave every new shard.

    Logged scalars, prefixed ``merge/``: ``stage``, ``shards`` (new shards), ``rounds_min``,
    ``rounds_max``, ``rounds_mean``, ``mean_abs_alpha`` (mean ``|alpha|`` of the merged
    children), ``mean_abs_group_alpha`` (mean over groups of ``|mean alpha|``: lower is better
    balanced).

    Args:
        filename: Name of the JSON-lines file inside the run directory.
    """

    def __init__(self, filename: str = "merges.jsonl") -> None:
        self.filename = filename
        self.records: list[dict[str, Any]] = []

    def on_fit_start(self, run: RunView) -> None:
        """Forget the records of an earlier fit."""
        self.records = []

    def on_stage_merge(
        self, run: RunView, stage: int, groups: Sequence[Sequence[int]], alphas: Any, rounds: Any
    ) -> None:
        """Record one merge decision."""
        alpha_list = [float(a) for a in (alphas.tolist() if hasattr(alphas, "tolist") else alphas)]
        round_list = [int(r) for r in (rounds.tolist() if hasattr(rounds, "tolist") else rounds)]
        grouping = [[int(c) for c in g] for g in groups]
        group_alpha = [
            (sum(alpha_list[c] for c in g) / len(g)) if g and alpha_list else 0.0 for g in grouping
        ]
        clients = self._clients(run.algorithm, stage, grouping)
        record = {
            "stage": int(stage),
            "groups": grouping,
            "clients": clients,
            "children_alphas": alpha_list,
            "group_mean_alpha": group_alpha,
            "rounds": round_list,
        }
        self.records.append(record)
        scalars = {
            "merge/stage": float(stage),
            "merge/shards": float(len(grouping)),
            "merge/rounds_min": float(min(round_list, default=0)),
            "merge/rounds_max": float(max(round_list, default=0)),
            "merge/rounds_mean": (sum(round_list) / len(round_list)) if round_list else 0.0,
            "merge/mean_abs_alpha": (
                sum(abs(a) for a in alpha_list) / len(alpha_list) if alpha_list else 0.0
            ),
            "merge/mean_abs_group_alpha": (
                sum(abs(a) for a in group_alpha) / len(group_alpha) if group_alpha else 0.0
            ),
        }
        if not run.is_global_zero:
            return
        if run.run_dir is not None:
            with open(run.run_dir / self.filename, "a") as f:
                f.write(json.dumps(record, allow_nan=False, default=_finite) + "\n")
        run.log(scalars, step=len(run.history))

    @staticmethod
    def _clients(algorithm: Any, stage: int, grouping: list[list[int]]) -> list[list[int]] | None:
        """The new shards' clients.

        The merge is announced before the stage trains, so the tree has only the stages before it;
        the new stage is built aside (the tree itself is immutable).
        """
        tree = getattr(algorithm, "tree", None)
        if tree is None:
            return None
        try:
            if tree.num_stages >= stage:
                return [list(tree.shard(stage, i).clients) for i in range(len(grouping))]
            return [list(sh.clients) for sh in tree.with_stage(grouping)[1]]
        except (IndexError, ValueError, AttributeError):
            return None


def _finite(value: Any) -> Any:
    """JSON fallback for numpy / tensor scalars."""
    out = float(value)
    return out if math.isfinite(out) else None
