"""The shard tree drawn as indented text (``tree.txt`` of a run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedshard_lightning.sharding.tree import ShardTree

__all__ = ["draw_tree"]


def draw_tree(tree: ShardTree, max_clients_shown: int = 8) -> str:
    """Top stage down to stage 1 (leaves not listed), at most ``max_clients_shown`` ids or ranges per shard."""
    header = (
        f"ShardTree: {tree.num_clients} clients, merge_rate {tree.merge_rate}, "
        f"{tree.num_stages}/{tree.planned_stages} stages"
    )
    lines = [header]

    def visit(stage: int, index: int, depth: int) -> None:
        shard = tree.shard(stage, index)
        ids = _format_ids(shard.clients, max_clients_shown)
        n = len(shard.clients)
        noun = "client" if n == 1 else "clients"
        lines.append(f"{'  ' * depth}stage {stage} shard {index} (clients {ids}, {n} {noun})")
        if stage > 1:
            for child in shard.children:
                visit(stage - 1, child, depth + 1)

    if tree.num_stages == 0:
        lines.append(f"stage 0: {tree.num_clients} leaf shards, one per client")
    else:
        for index in range(tree.stage_arrays(tree.num_stages).size):
            visit(tree.num_stages, index, 0)
    return "\n".join(lines)


def _format_ids(ids: Sequence[int], max_shown: int) -> str:
    """Compress sorted ids into ``0-3, 7, 9-12`` and cut the list after ``max_shown`` items."""
    runs: list[str] = []
    start = prev = None
    for c in ids:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = c
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
    if len(runs) > max(max_shown, 1):
        runs = [*runs[: max(max_shown, 1)], "..."]
    return ", ".join(runs)
