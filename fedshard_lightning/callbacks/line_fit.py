"""A status line that fits the terminal: the least useful parts go first, never the position or the ETA.

rich folds a live line wider than the terminal onto a second line (or crops it), and a redrawn
two-line status leaves debris on an 80-column terminal. So the live lines of ``fit``, ``unlearn``
and ``audit`` are built from ranked parts and the highest ranks are left out until the line fits.
Plain lines (logs, SLURM) keep every part: a file has no width.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fit_line"]

SEP = " · "


def fit_line(parts: Sequence[tuple[str, int]], width: int) -> str:
    """Join ``(text, rank)`` parts with `` · ``, leaving out the highest ranks until the line fits.

    Rank 0 parts always stay; if they alone are too wide the line is cut with an ellipsis.
    Among parts of equal rank the later one goes first.
    """
    kept = [(text, rank) for text, rank in parts if text]
    while len(SEP.join(t for t, _ in kept)) > width and any(r > 0 for _, r in kept):
        worst = max(r for _, r in kept)
        del kept[max(i for i, (_, r) in enumerate(kept) if r == worst)]
    line = SEP.join(t for t, _ in kept)
    return line if len(line) <= width else line[: max(width - 1, 0)] + "…"
