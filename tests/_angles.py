"""SPEC section 4's signed contribution angle, written with numpy alone (a reference for the tests)."""

from __future__ import annotations

import numpy as np


def numpy_signed_angles(u: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Arccos angle of every row of ``u`` to the ``w``-weighted mean row; sign from the principal residual."""
    g = (w[:, None] * u).sum(0) / w.sum()
    cos = (u @ g) / (np.linalg.norm(u, axis=1) * np.linalg.norm(g))
    angle = np.arccos(np.clip(cos, -1.0, 1.0))
    r = u - np.outer(u @ g / (g @ g), g)
    e = np.linalg.svd(r, full_matrices=False)[2][0]
    if e[np.argmax(np.abs(e))] < 0:
        e = -e
    return np.where(r @ e >= 0, angle, -angle)
