"""Signed contribution factor alpha of FedShard (paper eq. 1, made signed by SPEC section 4).

Paper: FedShard, eq. (1) defines ``alpha_c = arccos(<d theta, d theta_c> / (|d theta| |d theta_c|))``,
an angle in ``[0, pi]``, yet A1 (Algorithm 2, Appendix D.2) clusters shards into "large negative",
"average" and "large positive" angles. SPEC section 4 decides how to sign it:

- reference ``g`` = weighted mean of the compared updates (or a given reference update);
- unsigned angle ``a = arccos(clip(cos(u, g), -1, 1))`` (evaluated as the equal but better
  conditioned ``atan2(|r|, <u, g>/|g|)``);
- residuals ``r = u - (<u, g> / |g|^2) g``, their first principal direction ``e`` (top right-singular
  vector of the stacked residuals, *not* centered), oriented so that its largest-magnitude
  coordinate is positive; ``sign = +1 if <r, e> >= 0 else -1``; ``alpha = sign * a``.

Edge cases (our choices, the paper is silent): a zero update or a zero reference gives
``alpha = 0`` (a weighted mean that is zero up to rounding, as for updates that cancel out, counts
as zero); a residual at rounding level (``|r| <= 64 eps sqrt(D) |u|``) counts as zero, so an update
parallel to ``g`` (e.g. the only one, N = 1) gets exactly 0 (or pi) and sign +1; when all residuals
are zero the sign is ``+1``. Everything is computed in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

__all__ = ["flatten_update", "signed_angles", "unflatten_update"]


def signed_angles(
    updates: torch.Tensor,
    weights: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    method: Literal["auto", "dense", "lanczos"] = "auto",
) -> torch.Tensor:
    """Signed angle of every update to the reference update, in radians (SPEC section 4).

    Two ways to the principal direction of the residuals, equal up to rounding:

    - ``dense``: the residuals themselves, then the SVD of the smaller of their two Gram matrices
      (``O(N^2)`` or ``O(D^2)`` memory: 8.6 GB and minutes at ``N = 32,768``);
    - ``lanczos``: the top eigenvector of ``R^T R`` (``D <= N``) or ``R R^T`` by ARPACK's Lanczos
      (``scipy.sparse.linalg.eigsh``) with a :class:`~scipy.sparse.linalg.LinearOperator` that
      applies ``R = M (U - c g^T)`` through ``U`` and ``g`` (``c = <u, g>/|g|^2``, ``M`` zeroes the
      parallel rows): neither the residual matrix nor a Gram matrix is ever formed, so memory stays
      ``O(N + D)`` beyond ``updates`` and a product costs ``O(N D)``. The start vector is fixed, so
      the result is deterministic.

    ``auto`` takes ``dense`` when ``min(N, D) <= 256`` (small problems, where it is exact and
    cheap) and ``lanczos`` otherwise.

    Args:
        updates: ``[N, D]`` flattened updates ``theta_final - theta_initial``, one row per shard
            or client.
        weights: ``[N]`` non-negative aggregation weights of the rows for the reference update
            ``g``; uniform when ``None``. Ignored when ``reference`` is given.
        reference: ``[D]`` reference update ``g``; the weighted mean of ``updates`` when ``None``.
        method: How to find the principal direction (see above).

    Returns:
        ``[N]`` float64 angles in ``[-pi, pi]`` on the device of ``updates``.

    Raises:
        ValueError: On wrong shapes, non-finite values or invalid weights.
    """
    if updates.ndim != 2:
        raise ValueError(f"updates must have shape [N, D], got {tuple(updates.shape)}")
    u = updates.detach().to(torch.float64)
    n, d = u.shape
    if n == 0:
        return torch.zeros(0, dtype=torch.float64, device=u.device)
    if not torch.isfinite(u).all():
        raise ValueError("updates contain NaN or infinite values")
    if reference is None:
        g = _weighted_mean(u, weights)
    else:
        g = reference.detach().to(device=u.device, dtype=torch.float64)
        if g.shape != (d,):
            raise ValueError(f"reference must have shape [{d}], got {tuple(g.shape)}")
        if not torch.isfinite(g).all():
            raise ValueError("reference contains NaN or infinite values")

    g_sq = torch.dot(g, g)
    scale = float(torch.linalg.vector_norm(u, dim=1).max())
    # A mean that vanishes up to rounding (updates that cancel out) is a zero reference too.
    g_floor = 0.0 if reference is not None else 64 * n * torch.finfo(torch.float64).eps * scale
    if g_sq == 0 or float(torch.sqrt(g_sq)) <= g_floor:
        return torch.zeros(n, dtype=torch.float64, device=u.device)
    if method not in ("auto", "dense", "lanczos"):
        raise ValueError(f"method must be auto, dense or lanczos, got {method!r}")
    dots = u @ g
    coef = dots / g_sq
    # Residual norms from explicit residuals (not sqrt(|u|^2 - <u,g>^2/|g|^2), which cancels for
    # nearly parallel updates), a block of rows at a time: O(block * D) memory.
    r_norm = torch.empty(n, dtype=torch.float64, device=u.device)
    block = max(1, (1 << 22) // max(d, 1))
    for s in range(0, n, block):
        r_norm[s : s + block] = torch.linalg.vector_norm(
            u[s : s + block] - coef[s : s + block, None] * g, dim=1
        )
    # A residual at rounding level (an update parallel to g, e.g. the only one) is exactly zero:
    # its angle is then exactly 0 or pi and its sign +1, instead of digits of rounding noise.
    noise = 64 * torch.finfo(torch.float64).eps * (d**0.5) * torch.linalg.vector_norm(u, dim=1)
    parallel = r_norm <= noise
    r_norm[parallel] = 0.0
    # atan2(|r|, <u, g>/|g|) equals arccos(clip(cos(u, g), -1, 1)) in exact arithmetic but keeps full
    # precision near 0 and pi, where arccos loses half the digits; a zero update gives atan2(0, 0) = 0.
    angle = torch.atan2(r_norm, dots / torch.sqrt(g_sq))
    if method == "dense" or (method == "auto" and min(n, d) <= 256):
        residuals = u - coef[:, None] * g[None, :]
        residuals[parallel] = 0.0
        projections = _principal_projections(residuals)
    else:
        projections = _lanczos_projections(u, g, coef, ~parallel)
    return torch.where(projections >= 0, angle, -angle) + 0.0  # + 0.0 turns -0.0 into 0.0


def _weighted_mean(u: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    n = u.shape[0]
    if weights is None:
        return u.mean(dim=0)
    w = torch.as_tensor(weights).detach().to(device=u.device, dtype=torch.float64)
    if w.shape != (n,):
        raise ValueError(f"weights must have shape [{n}], got {tuple(w.shape)}")
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be finite, non-negative and have a positive sum")
    return (w @ u) / w.sum()


def _principal_projections(residuals: torch.Tensor) -> torch.Tensor:
    """``<r_i, e>`` for the oriented top right-singular vector ``e`` of the residuals (zeros if all are)."""
    n, d = residuals.shape
    if not residuals.any():
        return torch.zeros(n, dtype=torch.float64, device=residuals.device)
    if d > n:
        # Gram trick: R R^T = U S^2 U^T, and e = R^T u_1 / s_1, without an N x D factor. The Gram
        # matrix is symmetric: eigh gives its top eigenvector 2.6x faster than an SVD of it (N = 2048,
        # one thread: 3.3 s vs 8.7 s), equal to rounding (alpha only takes the sign of <r, e>).
        evals, evecs = torch.linalg.eigh(torch.mm(residuals, residuals.T))
        e = (residuals.T @ evecs[:, -1]) / torch.sqrt(evals[-1].clamp_min(torch.finfo(torch.float64).tiny))
    else:
        e = torch.linalg.svd(residuals, full_matrices=False)[2][0]
    if e[torch.argmax(e.abs())] < 0:
        e = -e
    return residuals @ e


def _lanczos_projections(
    u: torch.Tensor, g: torch.Tensor, coef: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """``<r_i, e>`` as :func:`_principal_projections`, without forming ``R`` or a Gram matrix.

    ``R = M (U - c g^T)`` with ``M = diag(keep)``; ``R x = M (U x - c <g, x>)`` and
    ``R^T y = U^T (M y) - g <c, M y>``. ARPACK finds the largest eigenpair of ``R^T R`` (``D x D``)
    when ``D <= N``, else of ``R R^T`` (``N x N``), from a fixed start vector.
    """
    n, d = u.shape
    if not bool(keep.any()):
        return torch.zeros(n, dtype=torch.float64, device=u.device)
    import numpy as np
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

    m = keep.to(torch.float64)
    mc = m * coef

    def r_mul(x: torch.Tensor) -> torch.Tensor:  # R x, x in R^D
        return m * (u @ x) - mc * torch.dot(g, x)

    def rt_mul(y: torch.Tensor) -> torch.Tensor:  # R^T y, y in R^N
        my = m * y
        return my @ u - g * torch.dot(coef, my)

    dev = u.device
    if d <= n:
        size = d

        def gram(v: np.ndarray) -> np.ndarray:
            x = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64).reshape(-1)).to(dev)
            return rt_mul(r_mul(x)).cpu().numpy()
    else:
        size = n

        def gram(v: np.ndarray) -> np.ndarray:
            y = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64).reshape(-1)).to(dev)
            return r_mul(rt_mul(y)).cpu().numpy()

    op = LinearOperator((size, size), matvec=gram, dtype=np.float64)
    # A fixed, generic start vector: deterministic results, and not orthogonal to the top
    # eigenvector in practice (ARPACK's own default start is random).
    v0 = np.cos(np.arange(1, size + 1, dtype=np.float64) * 0.7548776662466927) + 1.5
    try:
        _, vecs = eigsh(op, k=1, which="LA", v0=v0, tol=0.0, maxiter=max(1000, 20 * size))
    except ArpackNoConvergence as err:  # pragma: no cover - degenerate spectra only
        if err.eigenvectors is None or err.eigenvectors.shape[1] == 0:
            raise
        vecs = err.eigenvectors
    top = torch.from_numpy(np.ascontiguousarray(vecs[:, 0])).to(dev)
    if d <= n:
        e = top
    else:
        e = rt_mul(top)
        e = e / torch.linalg.vector_norm(e).clamp_min(torch.finfo(torch.float64).tiny)
    if e[torch.argmax(e.abs())] < 0:
        e = -e
    return r_mul(e)


def flatten_update(
    final: Mapping[str, torch.Tensor],
    initial: Mapping[str, torch.Tensor],
    stacked: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Flatten the update ``final - initial`` over all entries, in sorted key order.

    Sorted keys make the layout independent of dict insertion order, so updates of different
    shards (and of a cache reloaded from disk) line up coordinate by coordinate.

    Args:
        final: Parameters after training, name -> tensor.
        initial: Parameters before training, with the same keys. With ``stacked=True`` an entry may
            also lack the leading stack dimension (one initial model shared by all rows).
        stacked: Whether the tensors of ``final`` carry a leading stack dimension ``N``.
        dtype: Compute the difference in this dtype (e.g. ``torch.float64`` for exact angles);
            the promoted dtype of the inputs when ``None``.

    Returns:
        ``[D]``, or ``[N, D]`` when ``stacked``.

    Raises:
        ValueError: If the keys or shapes do not match.
    """
    keys = sorted(final)
    if set(keys) != set(initial):
        missing = sorted(set(final) ^ set(initial))
        raise ValueError(f"final and initial must have the same keys; these are in only one: {missing}")
    if not keys:
        raise ValueError("cannot flatten an empty parameter dict")
    n = final[keys[0]].shape[0] if stacked and final[keys[0]].ndim > 0 else None
    pieces = []
    for key in keys:
        f, i = final[key], initial[key]
        if dtype is not None:
            f, i = f.to(dtype), i.to(dtype)
        if stacked:
            if f.ndim == 0 or f.shape[0] != n:
                raise ValueError(f"entry {key!r} of final has shape {tuple(f.shape)}, expected [{n}, ...]")
            if i.shape not in (f.shape, f.shape[1:]):
                raise ValueError(
                    f"entry {key!r}: initial shape {tuple(i.shape)} does not match {tuple(f.shape)}"
                )
            pieces.append((f - i).reshape(n, -1))
        else:
            if i.shape != f.shape:
                raise ValueError(
                    f"entry {key!r}: initial shape {tuple(i.shape)} does not match {tuple(f.shape)}"
                )
            pieces.append((f - i).reshape(-1))
    return torch.cat(pieces, dim=-1)


def unflatten_update(
    vector: torch.Tensor,
    like: Mapping[str, torch.Tensor],
    stacked: bool = False,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`flatten_update`: split ``vector`` into tensors shaped like ``like``.

    Args:
        vector: ``[D]``, or ``[N, D]`` when ``stacked``.
        like: Name -> tensor giving the (unstacked) shape of every entry.
        stacked: Whether ``vector`` has a leading stack dimension ``N``; the result then does too.

    Returns:
        Name -> tensor, in sorted key order.

    Raises:
        ValueError: If the sizes do not add up to ``D``.
    """
    keys = sorted(like)
    sizes = [like[k].numel() for k in keys]
    if vector.shape[-1] != sum(sizes) or vector.ndim != (2 if stacked else 1):
        raise ValueError(f"vector of shape {tuple(vector.shape)} does not match {sum(sizes)} parameters")
    lead = tuple(vector.shape[:-1])
    parts = torch.split(vector, sizes, dim=-1)
    return {k: p.reshape((*lead, *like[k].shape)) for k, p in zip(keys, parts)}
