"""Plots of the unlearning replay: cost per client (violin, box, points) and accuracy per round.

Matplotlib's object API with the Agg canvas (no pyplot, no global backend state), imported lazily
so that training never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["plot_cost_distribution", "plot_round_accuracy"]


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # Agg canvas, no pyplot, no global backend state

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def plot_cost_distribution(
    costs: dict[str, Sequence[float]],
    path: str | Path,
    alphas: Sequence[float] | None = None,
    alpha_costs: Sequence[float] | None = None,
    title: str = "Unlearning cost per client",
) -> Path:
    """Violin + box + points of unlearning costs over clients, one panel per cost unit.

    Like the paper's cost-distribution figure (unlearning cost of every single-client request).
    With ``alphas``, a last panel shows the cost against ``|alpha_c|``: the relation M_e weighs.

    Args:
        costs: Panel title (e.g. ``"client-steps"``) -> cost of every client.
        path: Output PNG.
        alphas: Client alphas, aligned with ``alpha_costs``.
        alpha_costs: Costs plotted against ``|alpha|`` (default: the first panel's).
        title: Figure title.
    """
    panels = [(k, np.asarray(v, dtype=np.float64)) for k, v in costs.items() if len(v)]
    n = len(panels) + (1 if alphas is not None and len(alphas) else 0)
    fig = _figure(4.2 * max(n, 1), 4.0)
    axes = fig.subplots(1, max(n, 1), squeeze=False)[0]
    rng = np.random.default_rng(0)
    for ax, (label, vals) in zip(axes, panels):
        if np.ptp(vals) > 0 and len(vals) > 1:
            parts = ax.violinplot(vals, positions=[1], showextrema=False, widths=0.8)
            for body in parts["bodies"]:
                body.set_alpha(0.35)
        ax.boxplot(vals, positions=[1], widths=0.25, showfliers=False)
        ax.scatter(1 + rng.uniform(-0.18, 0.18, len(vals)), vals, s=12, alpha=0.7, color="tab:red", zorder=3)
        ax.axhline(float(vals.mean()), color="tab:green", ls="--", lw=1, label=f"mean {vals.mean():.4g}")
        ax.set_xticks([1], [f"{len(vals)} clients"])
        ax.set_ylabel(f"unlearning cost ({label})")
        ax.set_title(f"{label}: std {vals.std():.3g}")
        ax.legend(loc="best", fontsize=8)
    if n > len(panels):
        ax = axes[-1]
        ys = np.asarray(alpha_costs if alpha_costs is not None else panels[0][1], dtype=np.float64)
        ax.scatter(np.abs(np.asarray(alphas, dtype=np.float64)), ys, s=14, color="tab:blue")
        ax.set_xlabel("|alpha_c| (rad)")
        ax.set_ylabel("unlearning cost")
        ax.set_title("cost vs contribution")
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_round_accuracy(history: Sequence[dict[str, float]], path: str | Path, title: str = "") -> Path:
    """Test accuracy (and train loss) per global round, with a vertical line at every stage boundary.

    Like the paper's ablation figure (global model accuracy through FedShard's stages). Rounds
    without a test evaluation (``eval_every_n_rounds``) are skipped in the accuracy curve.
    """
    fig = _figure(7.5, 4.0)
    ax = fig.subplots()
    xs = [h.get("global_round", i + 1) for i, h in enumerate(history)]
    acc = [(x, h["test_accuracy"]) for x, h in zip(xs, history) if "test_accuracy" in h]
    loss = [(x, h["train_loss"]) for x, h in zip(xs, history) if "train_loss" in h]
    if acc:
        ax.plot(*zip(*acc), marker="o", ms=3, color="tab:blue", label="test accuracy")
    ax.set_xlabel("global round")
    ax.set_ylabel("test accuracy", color="tab:blue")
    handles = list(ax.get_lines())
    if loss:
        ax2 = ax.twinx()
        ax2.plot(*zip(*loss), color="tab:orange", ls="--", lw=1, label="train loss")
        ax2.set_ylabel("train loss", color="tab:orange")
        handles += list(ax2.get_lines())
    if handles:
        ax.legend(handles, [h.get_label() for h in handles], loc="center right", fontsize=8)
    if not history:
        ax.text(0.5, 0.5, "no rounds recorded", ha="center", va="center", transform=ax.transAxes)
    stages = [h.get("stage") for h in history]
    starts = [0] + [i for i in range(1, len(stages)) if stages[i] != stages[i - 1]]
    for j, i in enumerate(starts):
        if i > 0:
            ax.axvline(xs[i] - 0.5, color="gray", ls=":", lw=1.2)
        end = starts[j + 1] if j + 1 < len(starts) else len(stages)
        mid = (xs[i] + xs[end - 1]) / 2
        ax.text(
            mid, 1.01, f"stage {int(stages[i])}", transform=ax.get_xaxis_transform(), ha="center", fontsize=8
        )
    ax.grid(alpha=0.3)
    fig.suptitle(title or "Global model accuracy per round")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
