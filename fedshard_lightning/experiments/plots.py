"""Per-method distribution of the per-client unlearning cost (the paper's cost-distribution figure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["plot_cost_distributions"]


def plot_cost_distributions(
    path: Path, steps: Mapping[str, Sequence[float]], seconds: Mapping[str, Sequence[float]]
) -> Path:
    """One violin + box + points per method: client-steps (left) and seconds (right) per request.

    Args:
        path: PNG file to write.
        steps: Method -> cost in client-steps of unlearning each client alone (pooled over seeds).
        seconds: Method -> measured seconds of the same (only the measured clients).

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.4 * len(steps), 4.2))
    for ax, data, unit in ((axes[0], steps, "client-steps"), (axes[1], seconds, "seconds")):
        names = [m for m in data if len(data[m])]
        values = [np.asarray(data[m], dtype=float) for m in names]
        if values:
            pos = np.arange(1, len(names) + 1)
            ax.violinplot(values, positions=pos, showextrema=False)
            ax.boxplot(values, positions=pos, widths=0.15, showfliers=False)
            rng = np.random.default_rng(0)
            for p, v in zip(pos, values):
                ax.scatter(p + rng.uniform(-0.08, 0.08, len(v)), v, s=6, alpha=0.5)
            ax.set_xticks(pos, names, rotation=30, ha="right")
        ax.set_ylabel(f"unlearning cost per client ({unit})")
        ax.set_title(f"cost of unlearning one client, {unit}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
