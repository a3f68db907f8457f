"""Tables of a method comparison over seeds: mean ± std, units in every header, md/csv/json/LaTeX.

Every column names its unit, so that client-steps and seconds never share a header (M_e in
client-steps^2 and in s^2 are separate columns; M_e's ``1/|alpha|`` is per radian).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "aggregate", "write_tables"]

# key, header (with unit), LaTeX header
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("fit_client_steps", "fit (client-steps)", r"fit (steps)"),
    ("test_accuracy", "test acc (fraction)", r"acc"),
    ("t", "t (s / request)", r"$t$ (s)"),
    ("client_steps", "cost (client-steps / request)", r"cost (steps)"),
    ("cost_std_steps", "cost std over clients (client-steps)", r"std (steps)"),
    ("M_e_steps", "M_e (client-steps^2 / rad)", r"$M_e$ (steps$^2$/rad)"),
    ("M_e_latency", "M_e latency (steps^2 / rad)", r"$M_e$ lat. (steps$^2$/rad)"),
    ("M_e_seconds", "M_e (s^2 / rad)", r"$M_e$ (s$^2$/rad)"),
    ("M_p", "M_p (unitless, >= 4)", r"$M_p$"),
    ("mia_f1_before", "MIA F1 before (fraction)", r"F1 before"),
    ("mia_f1_after", "MIA F1 after (fraction)", r"F1 after"),
    ("mia_auc_before", "MIA AUC before (0.5: chance)", r"AUC before"),
    ("mia_auc_after", "MIA AUC after (0.5: chance)", r"AUC after"),
    ("mia_tpr_before", "MIA TPR at 1% FPR before", r"TPR@1\% before"),
    ("mia_tpr_after", "MIA TPR at 1% FPR after", r"TPR@1\% after"),
    ("test_accuracy_after", "test acc after (fraction)", r"acc after"),
    ("speedup_steps", "FA cost / cost (x, client-steps)", r"FA/\,cost"),
    ("r2_steps", "r2: one by one / together (x, client-steps)", r"$r_2$"),
)


def _num(v: Any) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def aggregate(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean, sample std and count over seeds for every method and column (method order kept).

    Args:
        rows: One row per (method, seed) with the keys of :data:`COLUMNS` and ``method``.

    Returns:
        One dict per method: ``{"method", "seeds", key: {"mean", "std", "n"}}``.
    """
    order: list[str] = []
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["method"] not in by:
            order.append(r["method"])
            by[r["method"]] = []
        by[r["method"]].append(r)
    out = []
    for m in order:
        entry: dict[str, Any] = {"method": m, "seeds": [r.get("seed") for r in by[m]]}
        for key, _, _ in COLUMNS:
            vals = [x for x in (_num(r.get(key)) for r in by[m]) if x is not None]
            entry[key] = {
                "mean": statistics.fmean(vals) if vals else None,
                "std": statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else None),
                "n": len(vals),
            }
        out.append(entry)
    return out


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    a = abs(x)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{x:.3g}"
    if a >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def _pm(cell: dict[str, Any], sep: str = " ± ") -> str:
    if cell["mean"] is None:
        return "-"
    if cell["n"] <= 1:
        return _fmt(cell["mean"])
    return f"{_fmt(cell['mean'])}{sep}{_fmt(cell['std'])}"


def write_tables(
    out: Path, agg: list[dict[str, Any]], rows: list[dict[str, Any]], meta: dict[str, Any]
) -> None:
    """``compare.md``, ``compare.csv`` (one row per method and seed), ``compare.json``, ``compare.tex``."""
    out.mkdir(parents=True, exist_ok=True)
    keys = ["method", "seed", *(k for k, _, _ in COLUMNS), "budget_rule", "rounds", "run_dir"]
    with open(out / "compare.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    n_seeds = len(meta.get("seeds", []))
    head = [
        f"Seeds {meta.get('seeds')} (mean ± sample std over {n_seeds} seeds); unlearned clients (each alone): "
        f"{meta.get('clients')}.",
        f"Budget: {meta.get('budget')}. t, cost and test acc after: means over the measured "
        "requests; cost std and M_e in client-steps: all clients, exact predicted costs; "
        "M_e in seconds: the measured clients; both M_e with the reference method's client alphas.",
        "",
        "| method | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    body = ["| " + e["method"] + " | " + " | ".join(_pm(e[k]) for k, _, _ in COLUMNS) + " |" for e in agg]
    rules = ["", "How each method's budget was matched:", ""]
    seen = set()
    for r in rows:
        if r["method"] not in seen:
            seen.add(r["method"])
            rules.append(f"- {r['method']} (seed {r.get('seed')}): {r.get('budget_rule')}")
    (out / "compare.md").write_text("\n".join(head + body + rules) + "\n")
    (out / "compare.json").write_text(json.dumps({**meta, "summary": agg, "rows": rows}, indent=2) + "\n")
    tex = [
        r"\begin{tabular}{l" + "r" * len(COLUMNS) + "}",
        r"\toprule",
        "method & " + " & ".join(t for _, _, t in COLUMNS) + r" \\",
        r"\midrule",
        *(
            e["method"].replace("_", r"\_")
            + " & "
            + " & ".join(_pm(e[k], r" $\pm$ ") for k, _, _ in COLUMNS)
            + r" \\"
            for e in agg
        ),
        r"\bottomrule",
        r"\end{tabular}",
    ]
    (out / "compare.tex").write_text("\n".join(tex) + "\n")
