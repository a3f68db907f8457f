"""The independent half of ``audit``: the run's record replayed by the per-client loop and a plain mean.

``audit`` certifies the deployed model (the cache's current one) in two ways:

1. **Bit-equality with the run's own engine.** The method replays itself (FedShard's ``_replay``
   of the whole frozen tree, a baseline's retraining) with the code that trained it. A
   deterministic procedure must give the same bits; this is the exactness guarantee, and it is
   what ``--tolerance`` (0 by default) judges.
2. **The difference from an independent reference.** :class:`ReferenceReplay` trains the same
   record (groups, initial models, rounds, keyed participants, batches and step keys, the clients
   that remain after unlearning) with none of the engine's round drivers, stacked kernels or
   aggregation: every client through the per-client loop kernel
   (:func:`~fedshard_lightning.engine.kernels.loop.run_client_loop`, the user's own
   ``configure_optimizers`` and ``training_step``), and every average as
   :func:`weighted_mean`, a sample-weighted mean accumulated in float64, written here apart from
   ``engine/aggregate.py`` and ``engine/mix_rows.py``. It certifies the algorithm, not only the
   engine's consistency: a replay that shared the engine's code could not see a fault in it.

The two computations round differently. In float64 they agree to about 1e-15. In float32 the
stacked kernels, the engine's blocked sums and the float32 products of the children's averages
round otherwise than the loop and a float64 mean, and training amplifies the rounding over rounds
and stages (figures in docs/unlearning.md). So the reference is judged by a relative
tolerance chosen by dtype (:data:`REFERENCE_RTOL`): tight in float64, where it certifies the
algorithm, loose in float32 and half precision, where it catches a wrong model (another client
set, a changed tree, a damaged weight) but not a rounding-sized fault; there the bit-equality
is the certificate.

Which methods have a reference: FedShard (the frozen tree), FedAvg retraining (one group of the
remaining clients) and FATS (one engine stage per round, its keyed sampler); the inexact
baselines have no audit at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedshard_lightning.engine import Group
from fedshard_lightning.engine.kernels.loop import ClientBatch

if TYPE_CHECKING:
    from fedshard_lightning.engine import FederatedEngine
    from fedshard_lightning.unlearning.base import Algorithm

__all__ = [
    "REFERENCE_RTOL",
    "ReferenceDiff",
    "ReferenceReplay",
    "TreeShard",
    "certify",
    "compare",
    "weighted_mean",
]

REFERENCE_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 5e-2,
    torch.bfloat16: 2e-1,
    torch.float16: 2e-1,
}
"""Largest accepted relative difference ``||deployed - reference|| / ||reference||`` by dtype."""


def weighted_mean(rows: Tensor, weights: Sequence[float]) -> Tensor:
    """``sum_i w_i rows[i] / sum_i w_i`` over dim 0, in float64, returned in ``rows``' dtype.

    The FedAvg average of the reference (``weights``: sample counts) and a shard's initial model
    from its children (``weights``: merge weights). Accumulating in float64 makes it a more
    accurate average than the engine's, not another rounding of the same one.
    """
    w = torch.as_tensor([float(x) for x in weights], dtype=torch.float64, device=rows.device)
    if w.numel() != rows.shape[0] or not w.numel():
        raise ValueError(f"weighted_mean: {rows.shape[0]} rows, {w.numel()} weights")
    total = w.sum()
    if not total > 0:
        raise ValueError(f"weighted_mean: the weights sum to {float(total)}")
    x = rows.to(torch.float64)
    return ((x * w.view(-1, *[1] * (x.ndim - 1))).sum(0) / total).to(rows.dtype)


@dataclass(frozen=True)
class TreeShard:
    """A shard of FedShard's frozen tree, as recorded at fit: children (previous stage), clients, rounds."""

    children: tuple[int, ...]
    clients: tuple[int, ...]
    rounds: int


class ReferenceReplay:
    """FedAvg of a recorded plan, client by client through the loop kernel, averaged by :func:`weighted_mean`.

    From the engine it takes the record of the run's randomness and settings only: the local
    trainer (model, data, optimizer, keyed batches and step keys, gradient clipping, learning-rate
    schedule), the participant policy, the client sizes, ``optimizer_state`` and FedBN's local
    layers. None of its round drivers, stacked kernels or aggregation runs.

    Args:
        engine: The algorithm's engine (set up for the run).
    """

    def __init__(self, engine: FederatedEngine) -> None:
        self.local = engine.local
        self.participants = engine.participants
        self.sizes = [int(n) for n in engine.sizes]
        self.keep_state = engine.keep_state
        self.local_names = list(engine.local_names)
        self.client_steps = 0

    def fedavg(self, init: dict[str, Tensor], group: Group, stage: int) -> dict[str, Tensor]:
        """``group.rounds`` FedAvg rounds of ``group`` from ``init`` (one model, unstacked) in ``stage``.

        A client's optimizer state (``optimizer_state: keep``) and FedBN local values last as long
        as the group trains, as they last one engine call in the run (a client is in one group per call).
        """
        state = {k: v.clone() for k, v in init.items()}
        saved = self.local.client_states
        self.local.client_states = {} if self.keep_state else None
        own: dict[int, dict[str, Tensor]] = {}  # FedBN: each client's local values
        try:
            for r in range(group.rounds):
                parts = [int(c) for c in self.participants(stage, group, r)]
                if not parts:
                    continue
                start = {k: v.unsqueeze(0).expand(len(parts), *v.shape).clone() for k, v in state.items()}
                for j, c in enumerate(parts):
                    for k, v in own.get(c, {}).items():
                        start[k][j] = v
                batch = ClientBatch(parts, [group.key] * len(parts), stage, r)
                res = self.local.train_loop(start, batch)
                self.client_steps += int(res.steps.sum())
                for j, c in enumerate(parts):
                    if self.local_names:
                        own[c] = {k: res.params[k][j].clone() for k in self.local_names}
                weights = [self.sizes[c] for c in parts]
                state = {k: weighted_mean(res.params[k], weights) for k in state}
        finally:
            self.local.client_states = saved
        return state

    def rounds_as_stages(
        self, init: dict[str, Tensor], clients: Sequence[int], rounds: int
    ) -> dict[str, Tensor]:
        """FedAvg trained one engine call per round: round r is stage r, group 0, round 0 (FATS)."""
        state = init
        for r in range(rounds):
            state = self.fedavg(state, Group(0, tuple(clients), 1), r)
        return state

    def tree(
        self,
        theta0: dict[str, Tensor],
        stages: Sequence[Sequence[TreeShard]],
        gone: set[int],
        client_weight: Callable[[int], float],
    ) -> dict[str, Tensor] | None:
        """The root model of a frozen tree retrained from ``theta0`` without ``gone`` (None: no client left).

        Stage 1 shards start from ``theta0``; a later shard starts from the :func:`weighted_mean` of
        its children that kept a client, weighted by the merge weights of their remaining clients
        (``client_weight``); a shard with no client left drops out. Each shard trains its recorded
        rounds as group ``index`` of its stage.
        """
        prev: list[dict[str, Tensor] | None] = []
        prev_w: list[float] = []
        for p, shards in enumerate(stages, start=1):
            models: list[dict[str, Tensor] | None] = []
            weights: list[float] = []
            for i, shard in enumerate(shards):
                remaining = tuple(c for c in shard.clients if c not in gone)
                if not remaining:
                    models.append(None)
                    weights.append(0.0)
                    continue
                if p == 1:
                    init = theta0
                    weight = float(sum(client_weight(c) for c in remaining))
                else:
                    live = [ch for ch in shard.children if prev_w[ch] > 0]
                    ws = [prev_w[ch] for ch in live]
                    init = {k: weighted_mean(torch.stack([prev[ch][k] for ch in live]), ws) for k in theta0}
                    weight = float(sum(ws))
                models.append(self.fedavg(init, Group(i, remaining, shard.rounds), p))
                weights.append(weight)
            prev, prev_w = models, weights
        return prev[0] if prev else None


@dataclass(frozen=True)
class ReferenceDiff:
    """How far the deployed model is from the reference: max |difference| and ``||d|| / ||reference||``."""

    max_abs: float
    relative: float

    @property
    def equal(self) -> bool:
        """The same bits."""
        return self.max_abs == 0.0


def compare(deployed: dict[str, Tensor], reference: dict[str, Tensor]) -> ReferenceDiff:
    """The difference over every tensor of ``deployed`` (names must match), computed in float64."""
    if set(deployed) != set(reference):
        raise ValueError(f"compare: tensors {sorted(set(deployed) ^ set(reference))} are in one model only")
    max_abs, sq_diff, sq_ref = 0.0, 0.0, 0.0
    for k, v in deployed.items():
        a, b = v.detach().to(torch.float64), reference[k].detach().to(device=v.device, dtype=torch.float64)
        d = a - b
        max_abs = max(max_abs, float(d.abs().max())) if d.numel() else max_abs
        if d.numel() and not torch.isfinite(d).all():
            max_abs = float("nan")
        sq_diff += float((d * d).sum())
        sq_ref += float((b * b).sum())
    relative = sq_diff**0.5 / sq_ref**0.5 if sq_ref > 0 else (0.0 if sq_diff == 0 else float("inf"))
    return ReferenceDiff(max_abs, relative)


def certify(
    algorithm: Algorithm, tolerance: float, reference: bool = True, reference_tolerance: float | None = None
) -> dict[str, Any]:
    """Both checks of ``audit`` on a loaded run (see the module docstring) and the verdict line.

    Args:
        algorithm: The run's algorithm, its state loaded.
        tolerance: Largest accepted max |difference| from the engine's replay (0: bit-exact).
        reference: Also replay the independent reference (a second, slower training).
        reference_tolerance: Largest accepted relative difference from the reference; None: the
            dtype's :data:`REFERENCE_RTOL`.

    Returns:
        The algorithm's ``audit`` result (``max_abs_diff``, ``final_max_abs_diff``, ``lines``, ...)
        with ``engine_passed``, ``bit_equal``, ``dtype`` and, where a reference ran,
        ``reference_max_abs_diff``, ``reference_rel_diff``, ``reference_tolerance`` and
        ``reference_passed``; ``passed`` is both verdicts.
    """
    result = algorithm.audit(tolerance)
    deployed = algorithm.current_params()
    dtype = next(iter(deployed.values())).dtype
    dname = str(dtype).removeprefix("torch.")
    engine_passed = bool(result["passed"])
    result.update(engine_passed=engine_passed, bit_equal=result["max_abs_diff"] == 0.0, dtype=dname)
    ref = algorithm.reference_params() if reference else None
    if ref is None:
        result["lines"].append(
            "independent reference: "
            + ("skipped (reference: false)" if not reference else f"none for {algorithm.name}")
        )
        ref_text = "no independent reference"
    else:
        rtol = REFERENCE_RTOL.get(dtype, 2e-1) if reference_tolerance is None else float(reference_tolerance)
        diff = compare(deployed, ref)
        ok = diff.relative <= rtol  # False for NaN
        if not ok:
            how = (
                f"more than rounding (relative tolerance {rtol:.1e} in {dname}): not the record's retraining"
            )
        elif diff.equal:
            how = "none"
        elif dtype == torch.float64:
            how = "float64 rounding"
        else:
            how = f"{dname} rounding (other kernels and sums), amplified by training"
        result["lines"].append(
            f"independent reference (the record through the per-client loop kernel, float64 sample-weighted "
            f"means): max|diff| = {diff.max_abs:.3e}, relative {diff.relative:.3e}: {how}"
        )
        ref_text = (
            f"independent reference max|diff| = {diff.max_abs:.3e}, relative {diff.relative:.3e}, "
            f"relative tolerance {rtol:.1e}"
        )
        result.update(
            reference_max_abs_diff=diff.max_abs,
            reference_rel_diff=diff.relative,
            reference_tolerance=rtol,
            reference_passed=ok,
            passed=engine_passed and ok,
        )
    verdict = "FAILED" if not result["passed"] else "PASSED, bit-exact" if result["bit_equal"] else "PASSED"
    engine = "bit-equal" if result["bit_equal"] else "NOT bit-equal"
    summary = result.get("summary", f"max|diff| = {result['max_abs_diff']:.3e}, tolerance {tolerance:.1e}")
    result["lines"].append(f"audit {verdict}: {dname}; engine replay {engine}: {summary}; {ref_text}")
    return result
