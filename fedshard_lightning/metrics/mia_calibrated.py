r"""Per-example calibrated membership inference: an offline LiRA test on the logit confidence.

Reference: Carlini et al., "Membership Inference Attacks From First Principles" (IEEE S&P 2022),
the *offline* likelihood-ratio attack with a fixed (global) variance, section IV.C; written here
from the paper's description, not from its code. The FedShard paper (section 6.3, Appendix G)
scores its attack by F1 only; we add the ROC AUC and the TPR at a low false-positive rate, which
the LiRA paper argues are the meaningful summaries of an attack's power.

For an example ``x`` with label ``y`` and a model ``f``, the *logit confidence* is

.. math::
    \phi(f, x) = \log \frac{p_y}{1 - p_y} = z_y - \log \sum_{j \ne y} e^{z_j},

with ``z`` the logits (computed this way it stays finite when ``p_y`` rounds to 1). Shadow
models trained *without* ``x`` (OUT models) give ``phi_1 .. phi_N``; the attack scores

.. math::
    s(x) = \frac{\phi(f_{\text{target}}, x) - \mu_{\text{out}}(x)}{\sigma},

where ``mu_out(x)`` is the mean over the OUT shadows of ``x`` and ``sigma`` the standard
deviation of the OUT confidences around their per-example means, pooled over all examples
(LiRA's fixed-variance variant, the recommended one with few shadows). A member has a higher
confidence under the target than under models that never saw it; the per-example mean removes
how easy the example is, which is what makes this attack stronger than a global loss threshold.
A larger ``s`` means "member".

Functions here are pure numpy; the shadow training and the federated protocol are in
:mod:`fedshard_lightning.experiments.mia_shadow`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "auc_difference_ci",
    "best_f1_threshold",
    "calibrated_scores",
    "f1_at_threshold",
    "logit_confidence",
    "roc_auc",
    "tpr_at_fpr",
]


def logit_confidence(logits: Tensor | np.ndarray, labels: Tensor | np.ndarray) -> np.ndarray:
    """``phi = z_y - logsumexp_{j != y} z_j`` per row: LiRA's logit-scaled confidence.

    Args:
        logits: ``(n, num_classes)`` raw outputs, ``num_classes >= 2``.
        labels: ``(n,)`` integer labels.

    Returns:
        float64 array ``(n,)``.

    Example:
        >>> import torch
        >>> float(logit_confidence(torch.tensor([[2.0, 0.0]]), torch.tensor([0]))[0])
        2.0
    """
    z = torch.as_tensor(logits).detach().to("cpu", torch.float64)
    y = torch.as_tensor(labels).detach().to("cpu", torch.long)
    if z.ndim != 2 or z.shape[1] < 2:
        raise ValueError(
            f"Expected argument `logits` to have shape (n, num_classes >= 2), got {tuple(z.shape)}."
        )
    if y.shape != (z.shape[0],):
        raise ValueError(f"Expected argument `labels` to have shape ({z.shape[0]},), got {tuple(y.shape)}.")
    if len(y) and not 0 <= int(y.min()) <= int(y.max()) < z.shape[1]:
        raise ValueError(f"Expected argument `labels` to lie in [0, {z.shape[1]}).")
    own = z.gather(1, y[:, None])[:, 0]
    others = z.scatter(1, y[:, None], -math.inf)
    return (own - torch.logsumexp(others, dim=1)).numpy()


def calibrated_scores(
    target: np.ndarray, shadows: np.ndarray, out_mask: np.ndarray | None = None, sigma: float | None = None
) -> tuple[np.ndarray, float]:
    """LiRA offline scores ``(phi_target - mu_out) / sigma`` and the ``sigma`` used.

    Args:
        target: ``(n,)`` confidences of the model under attack.
        shadows: ``(N, n)`` confidences of the shadow models.
        out_mask: ``(N, n)`` booleans, True where shadow ``i`` did not train on example ``j``;
            ``None``: every shadow is OUT for every example.
        sigma: Use this pooled standard deviation (e.g. the one of a larger set of examples);
            ``None`` estimates it from these examples (needs two OUT shadows for some example).

    Returns:
        ``(scores, sigma)``: float64 ``(n,)`` scores and the pooled standard deviation.

    Raises:
        ValueError: If shapes disagree or an example has no OUT shadow.
    """
    target = np.asarray(target, dtype=np.float64)
    shadows = np.asarray(shadows, dtype=np.float64)
    if shadows.ndim != 2 or shadows.shape[1] != target.shape[0]:
        raise ValueError(f"Expected `shadows` of shape (N, {target.shape[0]}), got {shadows.shape}.")
    mask = np.ones_like(shadows, dtype=bool) if out_mask is None else np.asarray(out_mask, dtype=bool)
    if mask.shape != shadows.shape:
        raise ValueError(f"Expected `out_mask` of shape {shadows.shape}, got {mask.shape}.")
    counts = mask.sum(axis=0)
    if (counts == 0).any():
        raise ValueError(f"{int((counts == 0).sum())} examples have no OUT shadow model: train more shadows.")
    mu = np.where(mask, shadows, 0.0).sum(axis=0) / counts
    if sigma is None:
        resid = np.where(mask, shadows - mu, 0.0)
        dof = int((counts - 1).sum())
        if dof < 1:
            raise ValueError("Estimating sigma needs an example with at least two OUT shadow models.")
        sigma = float(math.sqrt((resid**2).sum() / dof))
    sigma = max(float(sigma), 1e-12)
    return (target - mu) / sigma, sigma


def _check_scores(members: np.ndarray, nonmembers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = np.asarray(members, dtype=np.float64).ravel()
    n = np.asarray(nonmembers, dtype=np.float64).ravel()
    if not len(m) or not len(n):
        raise ValueError("Expected at least one member and one non-member score.")
    if not (np.isfinite(m).all() and np.isfinite(n).all()):
        raise ValueError("Expected finite scores.")
    return m, n


def roc_auc(members: np.ndarray, nonmembers: np.ndarray) -> float:
    r"""ROC AUC of "member" as the Mann-Whitney statistic: :math:`P(s_m > s_n) + \tfrac12 P(s_m = s_n)`.

    Example:
        >>> roc_auc([3.0, 2.0], [1.0, 2.0])
        0.875
    """
    m, n = _check_scores(members, nonmembers)
    from scipy.stats import rankdata

    ranks = rankdata(np.concatenate([m, n]))  # average ranks over ties, 1-based
    u = ranks[: len(m)].sum() - len(m) * (len(m) + 1) / 2.0
    return float(u / (len(m) * len(n)))


def tpr_at_fpr(members: np.ndarray, nonmembers: np.ndarray, fpr: float = 0.01) -> float:
    """Largest true-positive rate of a threshold whose false-positive rate is at most ``fpr``.

    With ``n`` non-members, ``a = floor(fpr * n)`` false positives are allowed: the threshold is
    the ``(a + 1)``-th largest non-member score and "member" means a score strictly above it.

    Example:
        >>> tpr_at_fpr([5.0, 4.0, 0.5], [3.0] + [0.0] * 99, fpr=0.01)
        0.6666666666666666
    """
    m, n = _check_scores(members, nonmembers)
    if not 0 <= fpr < 1:
        raise ValueError(f"Expected argument `fpr` in [0, 1), got {fpr!r}.")
    allowed = math.floor(fpr * len(n) + 1e-9)
    threshold = np.sort(n)[::-1][allowed]
    return float((m > threshold).mean())


def f1_at_threshold(members: np.ndarray, nonmembers: np.ndarray, threshold: float) -> float:
    """F1 of "member" (score > threshold) on the given members and non-members."""
    m, n = _check_scores(members, nonmembers)
    tp, fp = float((m > threshold).sum()), float((n > threshold).sum())
    fn = len(m) - tp
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def best_f1_threshold(members: np.ndarray, nonmembers: np.ndarray) -> float:
    """The threshold maximising F1 on a (fitting) set of known members and non-members."""
    m, n = _check_scores(members, nonmembers)
    cands = np.unique(np.concatenate([m, n]))
    cands = np.r_[cands[0] - 1.0, cands]
    scores = [f1_at_threshold(m, n, t) for t in cands]
    return float(cands[int(np.argmax(scores))])


def auc_difference_ci(
    pairs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    num_bootstrap: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """Paired bootstrap CI of the AUC of model A minus that of model B, averaged over settings.

    Each entry of ``pairs`` is one setting (e.g. one seed): ``(members_a, nonmembers_a,
    members_b, nonmembers_b)``, where A's and B's arrays score the *same* examples in the same
    order. Every bootstrap draw resamples, per setting, the member and the non-member positions
    with replacement (the same positions for A and B), and averages the per-setting differences.

    Returns:
        ``{"diff": ..., "low": ..., "high": ..., "auc_a": ..., "auc_b": ..., "auc_a_low": ...,
        "auc_a_high": ..., "auc_b_low": ..., "auc_b_high": ...}``: point estimates are the means
        over settings; bounds are percentile bounds at ``level``.
    """
    if not pairs:
        raise ValueError("Expected at least one setting.")
    rng = np.random.default_rng(seed)
    checked = []
    for ma, na, mb, nb in pairs:
        ma, na = _check_scores(ma, na)
        mb, nb = _check_scores(mb, nb)
        if ma.shape != mb.shape or na.shape != nb.shape:
            raise ValueError("Expected A and B to score the same examples (equal shapes).")
        checked.append((ma, na, mb, nb))
    point_a = float(np.mean([roc_auc(ma, na) for ma, na, _, _ in checked]))
    point_b = float(np.mean([roc_auc(mb, nb) for _, _, mb, nb in checked]))
    draws = np.empty((num_bootstrap, 2))
    for b in range(num_bootstrap):
        a_vals, b_vals = [], []
        for ma, na, mb, nb in checked:
            im = rng.integers(0, len(ma), len(ma))
            inn = rng.integers(0, len(na), len(na))
            a_vals.append(roc_auc(ma[im], na[inn]))
            b_vals.append(roc_auc(mb[im], nb[inn]))
        draws[b] = (np.mean(a_vals), np.mean(b_vals))
    lo, hi = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    diff = draws[:, 0] - draws[:, 1]
    return {
        "diff": point_a - point_b,
        "low": float(np.percentile(diff, lo)),
        "high": float(np.percentile(diff, hi)),
        "auc_a": point_a,
        "auc_b": point_b,
        "auc_a_low": float(np.percentile(draws[:, 0], lo)),
        "auc_a_high": float(np.percentile(draws[:, 0], hi)),
        "auc_b_low": float(np.percentile(draws[:, 1], lo)),
        "auc_b_high": float(np.percentile(draws[:, 1], hi)),
    }
