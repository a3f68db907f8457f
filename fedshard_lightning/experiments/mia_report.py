"""The calibrated MIA of one fitted method and its summary over seeds with bootstrap CIs (``mia.json``).

:func:`calibrated_mia` scores a fitted method before unlearning and after unlearning each audited
client alone (pure :meth:`~fedshard_lightning.unlearning.base.Algorithm.what_if` from the fitted
state). :func:`write_mia_summary` reports, per method, the AUC and the TPR at 1% FPR before and
after, averaged over seeds, with a percentile bootstrap CI over examples (resampled within each
seed), and every method's after-unlearning AUC minus FedAvg retraining's with a *paired* CI: both
methods score the same examples of the same seed, so the same resampled positions are used.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedshard_lightning.experiments.mia_shadow import CalibratedAudit, MIAScores, ShadowSet
from fedshard_lightning.metrics.mia_calibrated import auc_difference_ci, tpr_at_fpr

__all__ = ["calibrated_mia", "load_scores", "mia_markdown", "save_scores", "write_mia_summary"]


def calibrated_mia(
    algorithm: Any, trainer: Any, shadows: ShadowSet, clients: Sequence[int], seed: int, after: bool = True
) -> dict[str, MIAScores]:
    """``{"before": ..., "after": ...}`` scores of the fitted ``algorithm`` (its state is unchanged).

    ``after=False`` scores the fitted model only (no unlearning is run).
    """
    audit = CalibratedAudit(trainer.module, trainer.datamodule, shadows, clients, seed)
    before = audit.before(algorithm.current_params())
    if not after:
        return {"before": before}
    fitted = algorithm.state_dict()
    after_params = {c: algorithm.what_if(fitted, [c])[1].params for c in audit.audited}
    return {"before": before, "after": audit.after(after_params)}


def _tpr_ci(per_seed: list[MIAScores], num_bootstrap: int, seed: int) -> tuple[float, float, float]:
    rng = np.random.default_rng([seed, 1])
    point = float(np.mean([s.tpr_at_1fpr for s in per_seed]))
    draws = []
    for _ in range(num_bootstrap):
        vals = []
        for s in per_seed:
            m = s.members[rng.integers(0, len(s.members), len(s.members))]
            n = s.nonmembers[rng.integers(0, len(s.nonmembers), len(s.nonmembers))]
            vals.append(tpr_at_fpr(m, n, 0.01))
        draws.append(np.mean(vals))
    return point, float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def write_mia_summary(
    path: Path,
    arrays: dict[str, list[dict[str, MIAScores] | None]],
    reference: str,
    num_bootstrap: int = 1000,
) -> dict[str, Any]:
    """Write ``mia.json``: per method AUC/TPR before and after (mean over seeds, 95% CI) and vs FedAvg.

    Args:
        path: File to write.
        arrays: Per method label, one ``calibrated_mia`` result per seed (same seed order).
        reference: The method every other is named against in the file (``compare``'s first).
        num_bootstrap: Bootstrap draws.

    Returns:
        The summary written.
    """
    out: dict[str, Any] = {
        "attack": "offline LiRA (fixed variance) on the logit confidence, FedAvg shadow models",
        "ci": f"95% percentile bootstrap over examples within each seed, {num_bootstrap} draws",
        "reference": reference,
        "methods": {},
    }
    fa = arrays.get("fedavg")
    for method, per_seed in arrays.items():
        runs = [r for r in per_seed if r is not None]
        if not runs:
            continue
        entry: dict[str, Any] = {"seeds": len(runs)}
        for when in ("before", "after"):
            if any(when not in r for r in runs):
                continue
            ci = auc_difference_ci(
                [(r[when].members, r[when].nonmembers) * 2 for r in runs], num_bootstrap, seed=3
            )
            tpr, tlo, thi = _tpr_ci([r[when] for r in runs], num_bootstrap, 3)
            entry[when] = {
                "auc": ci["auc_a"],
                "auc_ci": [ci["auc_a_low"], ci["auc_a_high"]],
                "tpr_at_1fpr": tpr,
                "tpr_ci": [tlo, thi],
                "f1": float(np.mean([r[when].f1 for r in runs])),
                "per_seed_auc": [r[when].auc for r in runs],
            }
        if (
            fa is not None
            and method != "fedavg"
            and len(fa) == len(per_seed)
            and all(r is not None and "after" in r for r in [*fa, *per_seed])
        ):
            ci = auc_difference_ci(
                [
                    (r["after"].members, r["after"].nonmembers, f["after"].members, f["after"].nonmembers)
                    for r, f in zip(per_seed, fa)
                ],
                num_bootstrap,
                seed=4,
            )
            entry["after_auc_minus_fedavg"] = {"diff": ci["diff"], "ci": [ci["low"], ci["high"]]}
        out["methods"][method] = entry
    path.write_text(json.dumps(out, indent=2) + "\n")
    save_scores(path.with_name("mia_scores.npz"), arrays)
    return out


def save_scores(path: Path, arrays: dict[str, list[dict[str, MIAScores] | None]]) -> None:
    """Every method's per-seed scores (``mia_scores.npz``), so runs of other seeds can be pooled."""
    flat: dict[str, np.ndarray] = {}
    for method, per_seed in arrays.items():
        for i, r in enumerate(per_seed):
            for when, s in (r or {}).items():
                key = f"{method}|{i}|{when}"
                flat[key + "|members"], flat[key + "|nonmembers"] = s.members, s.nonmembers
                flat[key + "|f1"] = np.array([s.f1])
    np.savez_compressed(path, **flat)


def load_scores(paths: Sequence[Path]) -> dict[str, list[dict[str, MIAScores] | None]]:
    """Scores saved by :func:`save_scores` in several runs, their seeds concatenated in order."""
    out: dict[str, list[dict[str, MIAScores] | None]] = {}
    for path in paths:
        data = np.load(path)
        per: dict[str, dict[int, dict[str, MIAScores]]] = {}
        for key in data.files:
            method, i, when, part = key.split("|")
            if part != "members":
                continue
            base = f"{method}|{i}|{when}"
            score = MIAScores(data[key], data[base + "|nonmembers"], float(data[base + "|f1"][0]))
            per.setdefault(method, {}).setdefault(int(i), {})[when] = score
        for method, seeds in per.items():
            out.setdefault(method, []).extend(seeds[i] for i in sorted(seeds))
    return out


def mia_markdown(summary: dict[str, Any]) -> str:
    """The ``mia.json`` summary as a markdown table (appended to ``compare.md``)."""

    def ci(v: list[float]) -> str:
        return f"[{v[0]:.3f}, {v[1]:.3f}]"

    lines = [
        f"Membership inference: {summary['attack']}; {summary['ci']}.",
        "",
        "| method | AUC before [95% CI] | TPR@1%FPR before | AUC after [95% CI] | TPR@1%FPR after "
        "| F1 before / after | AUC after - FedAvg's [95% CI, paired] |",
        "|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    none = {"auc": nan, "auc_ci": [nan, nan], "tpr_at_1fpr": nan, "tpr_ci": [nan, nan], "f1": nan}
    for method, e in summary["methods"].items():
        b, a = e["before"], e.get("after", none)
        d = e.get("after_auc_minus_fedavg")
        diff = "-" if d is None else f"{d['diff']:+.3f} {ci(d['ci'])}"
        lines.append(
            f"| {method} | {b['auc']:.3f} {ci(b['auc_ci'])} | {b['tpr_at_1fpr']:.3f} {ci(b['tpr_ci'])} "
            f"| {a['auc']:.3f} {ci(a['auc_ci'])} | {a['tpr_at_1fpr']:.3f} {ci(a['tpr_ci'])} "
            f"| {b['f1']:.3f} / {a['f1']:.3f} | {diff} |"
        )
    return "\n".join(lines)
