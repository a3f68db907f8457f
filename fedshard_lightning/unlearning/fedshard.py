"""FedShard: sharded federated learning with exact, fair and fast federated unlearning.

The paper is in ``shared/paper`` (Algorithm 1 "FedShard Federated Learning", Algorithm 2 "FedShard Federated
Unlearning", Appendix D), made precise by SPEC sections 2, 4-7.

Training builds a frozen shard tree bottom-up: every client is a leaf; stage p merges the shards of
stage p-1, R at a time (A1: direction-balanced merging by the signed contribution angle alpha),
gives each new shard a number of FedAvg rounds (A2: fewer rounds for shards whose children
disagree), starts it from the weighted average of its children's models, and trains all shards of
the stage together in one vectorized engine call. The final shard's model is the result.

Unlearning a set L of clients retrains only the shards whose clients meet L (one per stage for one
client), bottom-up, each from the re-averaged models of its surviving children and for its cached
number of rounds with the same keyed randomness; unaffected shards keep their cached models. The
result equals a replay of the frozen tree from theta^0 without L (``audit`` checks it).

Departures from the paper, all from SPEC: alpha carries a sign from the principal residual
direction (section 4); A2 is the bounded, inverse-variance reading within [T0, T1] (section 5);
the tree shape and rounds are frozen metadata that were chosen with all clients present (section 7,
documented in docs/unlearning.md).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from fedshard_lightning.cache import FLCache, StackWrite
from fedshard_lightning.engine import Group, RoundInfo, TrainResult
from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.sharding import (
    A1Merge,
    A2Rounds,
    AutoRounds,
    FixedRounds,
    MergePolicy,
    RandomMerge,
    RoundPolicy,
    ShardTree,
    flatten_update,
    num_stages,
    signed_angles,
)
from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult

__all__ = ["FedShard", "ShardRecord"]


@dataclass
class ShardRecord:
    """What FLCache keeps of a shard besides its model."""

    children: list[int]
    clients: list[int]
    weight: float
    alpha: float
    rounds: int
    remaining: list[int]

    @property
    def empty(self) -> bool:
        """No client of this shard remains (it disappeared after unlearning)."""
        return not self.remaining

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "children": self.children,
            "clients": self.clients,
            "weight": self.weight,
            "alpha": self.alpha,
            "rounds": self.rounds,
            "remaining": self.remaining,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardRecord:
        """Inverse of :meth:`to_dict`."""
        return cls(
            [int(c) for c in d["children"]],
            [int(c) for c in d["clients"]],
            float(d["weight"]),
            float(d["alpha"]),
            int(d["rounds"]),
            [int(c) for c in d["remaining"]],
        )


def _merge_policy(merge: str | MergePolicy) -> MergePolicy:
    if isinstance(merge, MergePolicy):
        return merge
    if merge == "a1":
        return A1Merge()
    if merge == "random":
        return RandomMerge()
    raise ConfigError(f"algorithm.merge={merge!r}: choose a1, random or a MergePolicy class_path")


class FedShard(Algorithm):
    """Sharded FedAvg with exact unlearning.

    Args:
        merge_rate: R, children per merged shard (>= 2).
        merge: ``a1`` (direction-balanced, the paper's A1), ``random`` (naive sharding) or a
            :class:`~fedshard_lightning.sharding.MergePolicy`.
        rounds: ``a2`` (A2 within [t0, t1]), ``fixed`` (``fixed_rounds`` everywhere), ``auto``
            (A2 with [T0, T1] measured by training stages 1-2 to convergence), or a
            :class:`~fedshard_lightning.sharding.RoundPolicy`.
        t0: Fewest rounds of A2.
        t1: Most rounds of A2 (also the rounds of stage 1 and of the last stage, SPEC section 5).
        fixed_rounds: Rounds per shard for ``rounds: fixed``.
        merge_weighting: Aggregation weight of a client: ``clients`` (1 per client, the paper) or
            ``samples`` (its number of training samples).
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    name = "fedshard"

    def __init__(
        self,
        merge_rate: int = 2,
        merge: Literal["a1", "random"] | MergePolicy = "a1",
        rounds: Literal["a2", "fixed", "auto"] | RoundPolicy = "a2",
        t0: int = 2,
        t1: int = 8,
        fixed_rounds: int = 5,
        merge_weighting: Literal["clients", "samples"] = "clients",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(merge_rate, bool) or not isinstance(merge_rate, int) or merge_rate < 2:
            raise ConfigError(f"algorithm.merge_rate={merge_rate!r}: must be an integer >= 2")
        if merge_weighting not in ("clients", "samples"):
            raise ConfigError(f"algorithm.merge_weighting={merge_weighting!r}: choose clients or samples")
        if not isinstance(fixed_rounds, int) or fixed_rounds < 1:
            raise ConfigError(f"algorithm.fixed_rounds={fixed_rounds!r}: must be a positive integer")
        if not (isinstance(t0, int) and isinstance(t1, int)) or t0 < 1 or t0 > t1:
            raise ConfigError(f"algorithm.t0={t0!r}, algorithm.t1={t1!r}: need integers with 1 <= t0 <= t1")
        self.merge_rate = merge_rate
        self.merge_policy = _merge_policy(merge)
        self.merge_name = merge if isinstance(merge, str) else type(merge).__name__
        if isinstance(rounds, RoundPolicy):
            self.round_policy = rounds
        elif rounds == "a2":
            self.round_policy = A2Rounds(t0, t1)
        elif rounds == "fixed":
            self.round_policy = FixedRounds(fixed_rounds)
        elif rounds == "auto":
            self.round_policy = AutoRounds(max_rounds=max(t1, 2))
        else:
            raise ConfigError(
                f"algorithm.rounds={rounds!r}: choose a2, fixed, auto or a RoundPolicy class_path"
            )
        self.rounds_name = rounds if isinstance(rounds, str) else type(rounds).__name__
        self.t0, self.t1, self.fixed_rounds = t0, t1, fixed_rounds
        self.merge_weighting = merge_weighting
        self.theta0: dict[str, Tensor] | None = None
        self.tree: ShardTree | None = None
        self.records: list[list[ShardRecord]] = []
        self.models: list[dict[str, Tensor]] = []
        self.total_client_steps = 0
        self.stage_seconds: list[float] = []
        self._sizes: list[int] = []
        self._steps: list[int] = []
        # The committed version the in-memory state came from (cache root, version), and the shards
        # changed since, per stage (None: the whole stage is new): the next commit writes only those.
        self._base: tuple[str, str] | None = None
        self._dirty: dict[int, set[int] | None] = {}

    def hparams(self) -> dict[str, Any]:
        """Base settings plus the tree and round settings."""
        return {
            **super().hparams(),
            "merge_rate": self.merge_rate,
            "merge": repr(self.merge_policy),
            "rounds": repr(self.round_policy),
            "merge_weighting": self.merge_weighting,
        }

    # -- helpers ----------------------------------------------------------------------------------
    def attach(self, trainer: Any) -> None:
        """Build the engine; remember every client's sample count and local steps per round."""
        super().attach(trainer)
        self._sizes = [int(n) for n in trainer.datamodule.client_sizes]
        self._steps = [self.schedule.num_steps(n) for n in self._sizes]

    @property
    def planned_stages(self) -> int:
        """P, the number of stages for K clients at rate R."""
        return num_stages(self.num_clients, self.merge_rate)

    def _client_weight(self, c: int) -> float:
        return 1.0 if self.merge_weighting == "clients" else float(self._sizes[c])

    def _merge_seed(self, stage: int) -> int:
        return (self.trainer.seed * 1_000_003 + stage * 7919) % (2**32)

    def _children_average(
        self,
        stage: int,
        records: Sequence[ShardRecord],
        prev: dict[str, Tensor] | None,
        prev_records: Sequence[ShardRecord] | None,
    ) -> dict[str, Tensor]:
        """Initial models [N, ...] of the given shards of ``stage``: weighted average of their live children.

        Each shard sums its (at most R) children in their aggregation order, element-wise: O(N R D)
        work and memory, where a dense ``[N, N_prev]`` weight matrix times the stacked models took
        O(N N_prev D) (4.3 GB and about 5 TFLOP at stage 2 of K = 65,536); and a shard's result no
        longer depends on which other shards are averaged with it (a BLAS matmul's blocking does).
        """
        n = len(records)
        if stage == 1:
            return {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in self.theta0.items()}
        dev = next(iter(prev.values())).device
        width = max(len(r.children) for r in records)
        index = [list(r.children) + [0] * (width - len(r.children)) for r in records]
        weight = [
            [0.0 if prev_records[ch].empty else prev_records[ch].weight for ch in r.children]
            + [0.0] * (width - len(r.children))
            for r in records
        ]
        idx = torch.tensor(index, dtype=torch.long, device=dev)
        w = torch.tensor(weight, dtype=torch.float64, device=dev)
        w = w / w.sum(1, keepdim=True).clamp_min(1e-300)
        out = {}
        for k, v in prev.items():
            flat = v.reshape(v.shape[0], -1)
            wk = w.to(flat.dtype)
            acc = wk[:, :1] * flat[idx[:, 0]]
            for j in range(1, width):
                acc = acc + wk[:, j : j + 1] * flat[idx[:, j]]
            out[k] = acc.reshape(n, *v.shape[1:])
        return out

    def _train_stage(
        self, stage: int, init: dict[str, Tensor], groups: list[Group], report: bool
    ) -> TrainResult:
        tracker = None
        if report and self.round_policy.calibrating(stage):
            tracker = self.round_policy.make_tracker(len(groups))
            last = [float("inf")] * len(groups)

            def on_round(info: RoundInfo, state: dict[str, Tensor]) -> list[bool]:
                for pos, loss in zip(info.active, info.mean_loss):
                    last[pos] = loss
                return tracker.update(last)

            res = self.train(init, groups, stage, on_round_end=on_round, report=report)
            self.round_policy.observe(stage, res.rounds_run)
            return res
        return self.train(init, groups, stage, report=report)

    # -- training ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, Tensor]:
        """Stages 1..P (or the remaining ones after a resume); returns theta_1^P."""
        if self.tree is None:
            self.theta0 = self.trainer.theta0
            self.tree = ShardTree(self.num_clients, self.merge_rate)
            self.records, self.models = [], []
            self.total_client_steps = 0
            self._dirty = {}
        for stage in range(len(self.records) + 1, self.planned_stages + 1):
            t = time.perf_counter()
            if stage == 1:
                prev_alpha = [0.0] * self.num_clients
                prev_counts = [1] * self.num_clients
                prev_weights = [self._client_weight(c) for c in range(self.num_clients)]
            else:
                prev_alpha = [r.alpha for r in self.records[-1]]
                prev_counts = [len(r.clients) for r in self.records[-1]]
                prev_weights = [r.weight for r in self.records[-1]]
            grouping = self.merge_policy.group(
                prev_alpha, prev_counts, self.merge_rate, self._merge_seed(stage)
            )
            shards = self.tree.add_stage(grouping)
            children_alphas = [[prev_alpha[c] for c in g] for g in grouping]
            rounds = self.round_policy.rounds(stage, children_alphas)
            records = [
                ShardRecord(
                    children=list(sh.children),
                    clients=list(sh.clients),
                    weight=float(sum(prev_weights[c] for c in sh.children)),
                    alpha=0.0,
                    rounds=int(rounds[i]),
                    remaining=list(sh.clients),
                )
                for i, sh in enumerate(shards)
            ]
            self.trainer.fabric.call(
                "on_stage_merge", self.trainer, stage=stage, groups=grouping, alphas=prev_alpha, rounds=rounds
            )
            groups = [Group(i, tuple(r.clients), r.rounds) for i, r in enumerate(records)]
            self.trainer.stage_start(stage, groups)
            prev = self.models[-1] if self.models else None
            prev_rec = self.records[-1] if self.records else None
            init = self._children_average(stage, records, prev, prev_rec)
            res = self._train_stage(stage, init, groups, report=True)
            for rec, used in zip(records, res.rounds_run):
                rec.rounds = int(used)
            updates = flatten_update(res.params, init, stacked=True, dtype=torch.float64)
            w = torch.tensor([r.weight for r in records], dtype=torch.float64, device=updates.device)
            alphas = signed_angles(updates, w) if len(records) > 1 else torch.zeros(1, dtype=torch.float64)
            for rec, a in zip(records, alphas.tolist()):
                rec.alpha = float(a)
            self.records.append(records)
            self.models.append(res.params)
            self._dirty[stage] = None
            self.total_client_steps += res.client_steps
            self.stage_seconds.append(time.perf_counter() - t)
            stage_metrics = {
                "shards": float(len(records)),
                "client_steps": float(res.client_steps),
                "seconds": self.stage_seconds[-1],
                "mean_abs_alpha": float(alphas.abs().mean()),
                "rounds_min": float(min(r.rounds for r in records)),
                "rounds_max": float(max(r.rounds for r in records)),
            }
            acc, loss = self.trainer.evaluate(self._stage_average(stage))
            stage_metrics.update(test_accuracy=acc, test_loss=loss)
            self.trainer.stage_end(stage, stage_metrics)
        if self.trainer.is_global_zero and self.trainer.run_dir is not None:
            (self.trainer.run_dir / "tree.txt").write_text(self.tree.pretty() + "\n")
        return self.current_params()

    def _stage_average(self, stage: int) -> dict[str, Tensor]:
        """theta^p: weighted average of the live shards of a stage."""
        recs = self.records[stage - 1]
        models = self.models[stage - 1]
        w = torch.tensor([0.0 if r.empty else r.weight for r in recs], dtype=torch.float64)
        w = w / w.sum()
        return {k: (v * w.to(v).view(-1, *[1] * (v.ndim - 1))).sum(0) for k, v in models.items()}

    def current_params(self) -> dict[str, Tensor]:
        """theta_1^P with every applied request."""
        return {k: v[0].clone() for k, v in self.models[-1].items()}

    # -- costs ------------------------------------------------------------------------------------
    def _shard_cost(self, stage: int, index: int, remaining: Sequence[int], rounds: int) -> int:
        if not remaining:
            return 0
        if self.client_fraction >= 1.0 and self.engine.participants_fn is None:
            # Every client takes part in every round (SPEC section 3): no per-round sample to draw.
            return rounds * sum(self._steps[c] for c in remaining)
        group = Group(index, tuple(remaining), rounds)
        return sum(
            self.engine.client_steps_of(self.engine.participants(stage, group, r)) for r in range(rounds)
        )

    def _plan(self, clients: Sequence[int]) -> dict[int, list[int]]:
        """Affected shard indices per stage for new leaving clients."""
        leaving = set(clients)
        return {
            p: [i for i, r in enumerate(recs) if leaving & set(r.remaining)]
            for p, recs in enumerate(self.records, start=1)
        }

    def predict_cost(self, clients: Sequence[int]) -> int:
        """Client-steps of retraining the affected shards, from the tree alone."""
        gone = set(self.unlearned) | set(clients)
        total = 0
        for p, idx in self._plan(clients).items():
            for i in idx:
                rec = self.records[p - 1][i]
                total += self._shard_cost(p, i, [c for c in rec.clients if c not in gone], rec.rounds)
        return total

    def retrain_cost(self, clients: Sequence[int]) -> int:
        """Client-steps of recomputing every shard of the frozen tree without the unlearned clients."""
        gone = set(self.unlearned) | set(clients)
        return sum(
            self._shard_cost(p, i, [c for c in rec.clients if c not in gone], rec.rounds)
            for p, recs in enumerate(self.records, start=1)
            for i, rec in enumerate(recs)
        )

    # -- unlearning -------------------------------------------------------------------------------
    def _replay(self, gone: set[int], only: dict[int, list[int]] | None) -> tuple[list, list, int, list]:
        """Recompute shards bottom-up without ``gone``: the listed ones (``only``) or all of them."""
        records = [[ShardRecord(**{**r.to_dict()}) for r in recs] for recs in self.records]
        models = [dict(m) for m in self.models]
        steps = 0
        retrained = []
        for p in range(1, len(records) + 1):
            recs = records[p - 1]
            for rec in recs:
                rec.remaining = [c for c in rec.clients if c not in gone]
                if p == 1:
                    rec.weight = float(sum(self._client_weight(c) for c in rec.remaining))
                else:
                    rec.weight = float(sum(records[p - 2][ch].weight for ch in rec.children))
            idx = [
                i for i in range(len(recs)) if (only is None or i in only.get(p, ())) and not recs[i].empty
            ]
            if not idx:
                continue
            sub = [recs[i] for i in idx]
            prev = models[p - 2] if p > 1 else None
            prev_rec = records[p - 2] if p > 1 else None
            init = self._children_average(p, sub, prev, prev_rec)
            groups = [Group(i, tuple(recs[i].remaining), recs[i].rounds) for i in idx]
            res = self.train(init, groups, p, report=False)
            steps += res.client_steps
            idx_t = torch.as_tensor(idx, device=next(iter(res.params.values())).device)
            models[p - 1] = {
                k: v.clone().index_copy_(0, idx_t, res.params[k]) for k, v in models[p - 1].items()
            }
            retrained.extend((p, i) for i in idx)
        return records, models, steps, retrained

    def unlearn(self, clients: Sequence[int]) -> UnlearnResult:
        """Retrain only the shards whose clients meet ``clients``, stage by stage."""
        plan = self._plan(clients)
        predicted = self.predict_cost(clients)
        retrain = self.retrain_cost(clients)
        gone = set(self.unlearned) | set(clients)
        t = time.perf_counter()
        records, models, steps, retrained = self._replay(gone, plan)
        seconds = time.perf_counter() - t
        self.records, self.models = records, models
        self.unlearned = sorted(gone)
        for p, i in retrained:
            rows = self._dirty.setdefault(p, set())
            if rows is not None:
                rows.add(i)
        emptied = [(p, i) for p, recs in enumerate(records, start=1) for i, r in enumerate(recs) if r.empty]
        return UnlearnResult(
            self.current_params(),
            steps,
            predicted,
            retrain,
            seconds,
            details={
                "retrained_shards": [{"stage": p, "shard": i} for p, i in retrained],
                "empty_shards": [{"stage": p, "shard": i} for p, i in emptied],
                "theoretical_r1": self.theoretical_speedup(),
            },
        )

    def theoretical_speedup(self) -> float:
        """The paper's Proposition 1 approximation r1 = (R-1)/R * K/(K-1) * P."""
        k, r = self.num_clients, self.merge_rate
        return (r - 1) / r * k / (k - 1) * self.planned_stages

    def audit(self, tolerance: float) -> dict[str, Any]:
        """Replay the whole frozen tree without every unlearned client; compare with the cache."""
        records, models, steps, _ = self._replay(set(self.unlearned), None)
        lines, worst = [], 0.0
        per_shard = []
        for p, (mine, ref, recs) in enumerate(zip(self.models, models, records), start=1):
            stage_worst = 0.0
            for i, rec in enumerate(recs):
                if rec.empty:
                    continue
                d = max(float((mine[k][i] - ref[k][i]).abs().max()) for k in mine)
                per_shard.append({"stage": p, "shard": i, "max_abs_diff": d})
                stage_worst = max(stage_worst, d)
                if len(recs) <= 64:
                    lines.append(f"stage {p} shard {i}: max|diff| = {d:.3e}")
            lines.append(
                f"stage {p}: max|diff| over {sum(not r.empty for r in recs)} shards = {stage_worst:.3e}"
            )
            worst = max(worst, stage_worst)
        final = max(float((self.models[-1][k][0] - models[-1][k][0]).abs().max()) for k in self.models[-1])
        passed = worst <= tolerance
        lines.append(
            f"audit {'PASSED' if passed else 'FAILED'}: final model max|diff| = {final:.3e}, worst shard "
            f"{worst:.3e}, tolerance {tolerance:.1e}; unlearned clients {self.unlearned}; replay cost {steps} client-steps"
        )
        return {
            "passed": passed,
            "max_abs_diff": worst,
            "final_max_abs_diff": final,
            "shards": per_shard,
            "lines": lines,
        }

    # -- cache ------------------------------------------------------------------------------------
    def _structure(self, stage: int) -> dict[str, Tensor]:
        """The frozen metadata of a stage's shards: children (in aggregation order), alpha, rounds.

        It never changes after the stage is trained, so its blob is written once per run and every
        later version shares it; clients, remaining clients and weights follow from the tree, the
        unlearned clients and the client weights (:meth:`_records_from`).
        """
        recs = self.records[stage - 1]
        lengths = torch.tensor([len(r.children) for r in recs], dtype=torch.int64)
        return {
            "children": torch.tensor([c for r in recs for c in r.children], dtype=torch.int64),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "alpha": torch.tensor([r.alpha for r in recs], dtype=torch.float64),
            "rounds": torch.tensor([r.rounds for r in recs], dtype=torch.int64),
        }

    def write_cache(self, cache: FLCache, label: str) -> str:
        """theta^0, one blob per shard model, the stages' frozen structure and the request state.

        Only the shards that changed since the committed version the state came from are written
        (a request adds the shards it retrained); when that version is not the cache's current one,
        every row is hashed and only blobs that do not exist yet are written.
        """
        stages = len(self.records)
        manifest = {
            **self.manifest_base(complete=stages == self.planned_stages),
            "merge_rate": self.merge_rate,
            "planned_stages": self.planned_stages,
            "stages_done": stages,
            "round_policy_state": self.round_policy.state_dict(),
        }
        tensors = {
            "theta0.safetensors": self.theta0,
            "client_sizes.safetensors": {"sizes": torch.tensor(self._sizes, dtype=torch.int64)},
        }
        for p in range(1, stages + 1):
            tensors[f"structure_{p}.safetensors"] = self._structure(p)
        clean = cache.exists() and self._base == (str(cache.root), cache.current())
        stacks = {}
        for p, m in enumerate(self.models, start=1):
            rows = self._dirty.get(p, ()) if clean else None
            stacks[f"stage_{p}"] = StackWrite(m, None if rows is None else sorted(rows))
        version = cache.commit(cache.next_name(label), manifest, tensors, stacks=stacks)
        self._base, self._dirty = (str(cache.root), version), {}
        return version

    def _records_from(self, structures: list[dict[str, Tensor]]) -> list[list[ShardRecord]]:
        """Records of every stage from the frozen structure, the tree and the unlearned clients.

        Remaining clients and weights are recomputed exactly as :meth:`_replay` does after a request
        (weights are sums of integer-valued client weights, so the order of summation is exact).
        """
        gone = set(self.unlearned)
        stages = self.tree.stages
        records: list[list[ShardRecord]] = []
        for p, st in enumerate(structures, start=1):
            alpha, rounds = st["alpha"].tolist(), st["rounds"].tolist()
            shards = stages[p]
            if len(alpha) != len(shards) or len(rounds) != len(shards):
                raise CacheError(f"structure of stage {p}: {len(alpha)} shards, the tree has {len(shards)}")
            recs = []
            for i, sh in enumerate(shards):
                remaining = [c for c in sh.clients if c not in gone] if gone else list(sh.clients)
                if p == 1:
                    weight = float(sum(self._client_weight(c) for c in remaining))
                else:
                    weight = float(sum(records[-1][ch].weight for ch in sh.children))
                recs.append(
                    ShardRecord(
                        list(sh.children), list(sh.clients), weight, alpha[i], int(rounds[i]), remaining
                    )
                )
            records.append(recs)
        return records

    def _restore(self, cache: FLCache) -> dict[str, Any]:
        manifest = self.trainer.check_manifest(cache, self.name)
        version = cache.current()
        if manifest.get("num_clients") != self.num_clients or manifest.get("merge_rate") != self.merge_rate:
            raise CacheError(f"{cache.root}: the cache was made for another number of clients or merge rate")
        device = self.trainer.device
        self.theta0 = cache.tensors("theta0.safetensors", version=version, device=device, manifest=manifest)
        stages = manifest.get("stages_done")
        if isinstance(stages, bool) or not isinstance(stages, int) or not 0 <= stages <= self.planned_stages:
            raise CacheError(f"{cache.root}: the manifest's stage count {stages!r} is malformed")
        structures = [
            cache.tensors(f"structure_{p}.safetensors", version=version, manifest=manifest)
            for p in range(1, stages + 1)
        ]
        self.unlearned = [int(c) for c in manifest.get("unlearned", [])]
        try:
            children = []
            for st in structures:
                flat, offsets = st["children"].tolist(), st["offsets"].tolist()
                children.append([flat[a:b] for a, b in itertools.pairwise(offsets)])
            self.tree = ShardTree.from_dict(
                {
                    "version": 1,
                    "num_clients": self.num_clients,
                    "merge_rate": self.merge_rate,
                    "stages": children,
                }
            )
            self.records = self._records_from(structures)
        except (KeyError, TypeError, ValueError) as e:
            raise CacheError(f"{cache.root}: the cached tree is malformed ({e})") from None
        self.models = [
            cache.stack(f"stage_{p}", version=version, device=device, manifest=manifest)
            for p in range(1, stages + 1)
        ]
        self._base, self._dirty = (str(cache.root), version), {}
        self.total_client_steps = int(manifest.get("client_steps", 0))
        if "round_policy_state" in manifest:
            self.round_policy.load_state_dict(manifest["round_policy_state"])
        return manifest

    def resume(self, cache: FLCache) -> bool:
        """Continue an interrupted fit after its last complete stage."""
        self._restore(cache)
        if self.unlearned:
            raise CacheError(f"{cache.root}: this run has unlearning requests already; it cannot be resumed")
        return True

    def load_cache(self, cache: FLCache) -> None:
        """Restore a finished fit (with every applied request)."""
        manifest = self._restore(cache)
        if not manifest.get("complete"):
            raise CacheError(
                f"{cache.root}: training stopped after stage {len(self.records)} of {self.planned_stages}; "
                "resume it with fit --ckpt_path RUN_DIR first"
            )
