"""FedShard's costs and certificate: predicted unlearning cost, retraining cost, the paper's r1, audit.

A mixin of :class:`~fedshard_lightning.unlearning.fedshard.FedShard` (paper section 4.3,
Proposition 1; SPEC sections 6-7): the cost of a request is computed from the frozen tree before
running it (client-steps, keyed participants), and ``audit`` replays the whole tree without every
unlearned client and compares every shard with the cache, bit for bit by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from fedshard_lightning.engine import Group
from fedshard_lightning.sharding import (
    StageCosts,
    eq7_weights,
    expected_future_costs,
    tree_client_costs,
)
from fedshard_lightning.sharding.round_rules import round_rule
from fedshard_lightning.unlearning.reference import ReferenceReplay, TreeShard

__all__ = ["ShardCosts"]


class ShardCosts:
    """Cost prediction and audit over FedShard's frozen tree (mixed into FedShard)."""

    def _stage_costs(self, stage: int) -> StageCosts:
        """A1's cost model for ``stage``: costs paid in the trained stages, expected rounds and later costs.

        From stage 2 on, every client weighs ``1 / |alpha|`` of its stage-1 shard (paper eq. 7, SPEC
        section 5); a policy that wants uniform weights drops them (``A1Merge(weighting="uniform")``).
        """
        planned = self.planned_stages
        if stage == 1:
            children = [[c] for c in range(self.num_clients)]
        else:
            children = [list(r.clients) for r in self.records[-1]]
        paid = tree_client_costs(
            [[(r.clients, r.rounds) for r in recs] for recs in self.records], self._steps
        )
        later_shards, later_rounds, n = [], [], -(-len(children) // self.merge_rate)
        for p in range(stage + 1, planned + 1):
            n = -(-n // self.merge_rate)
            later_shards.append(n)
            later_rounds.append(self.round_policy.expected_rounds(p, last=p == planned))
        return StageCosts(
            shard_clients=children,
            client_steps=self._steps,
            paid=paid,
            rounds=self.round_policy.expected_rounds(stage, last=stage == planned),
            future=expected_future_costs(self._steps, later_shards, later_rounds),
            weights=eq7_weights(
                [r.clients for r in self.records[0]], [r.alpha for r in self.records[0]], self.num_clients
            )
            if self.records
            else None,
            rounds_fn=None
            if self.round_policy.calibrating(stage)
            else lambda children_alphas: self.round_policy.rounds(stage, children_alphas),
            rounds_rule=round_rule(self.round_policy, stage),  # None while calibrating
        )

    def _shard_cost(
        self, stage: int, index: int, remaining: Sequence[int], rounds: int, latency: bool = False
    ) -> int:
        """Client-steps (or, with ``latency``, the sum of every round's slowest step count) of a shard."""
        if not remaining:
            return 0
        if self.engine.samples_everyone:
            # Every client takes part in every round (SPEC section 3): no per-round sample to draw.
            steps = [self._steps[c] for c in remaining]
            return rounds * (max(steps) if latency else sum(steps))
        group = Group(index, tuple(remaining), rounds)
        per_round = self.engine.latency_of if latency else self.engine.client_steps_of
        return sum(per_round(self.engine.participants(stage, group, r)) for r in range(rounds))

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

    def predict_latency(self, clients: Sequence[int]) -> int:
        """Latency in steps: stage by stage, the slowest affected shard (shards retrain in parallel)."""
        gone = set(self.unlearned) | set(clients)
        return sum(
            max(
                (
                    self._shard_cost(
                        p,
                        i,
                        [c for c in self.records[p - 1][i].clients if c not in gone],
                        self.records[p - 1][i].rounds,
                        latency=True,
                    )
                    for i in idx
                ),
                default=0,
            )
            for p, idx in self._plan(clients).items()
        )

    def retrain_cost(self, clients: Sequence[int]) -> int:
        """Client-steps of recomputing every shard of the frozen tree without the unlearned clients."""
        gone = set(self.unlearned) | set(clients)
        return sum(
            self._shard_cost(p, i, [c for c in rec.clients if c not in gone], rec.rounds)
            for p, recs in enumerate(self.records, start=1)
            for i, rec in enumerate(recs)
        )

    def ratio_counting_leaving(self, clients: Sequence[int]) -> float:
        """The paper's r1 measured: the leaving clients' own steps counted on both sides.

        Proposition 1 divides the training of the whole tree (``T_train = P T K``, every client
        counted) by the retraining of the affected shards *with* their full client counts
        (``T_un = sum_p T R^p``). :meth:`retrain_cost` / :meth:`predict_cost` (the trainer's
        ``speedup_client_steps``) leave the leaving clients out of both sides instead. With fixed
        rounds, equal client sizes and ``K = R**P`` this equals ``theoretical_speedup()`` exactly.
        """
        before = set(self.unlearned)
        leaving = set(clients)
        total = affected = 0
        for p, recs in enumerate(self.records, start=1):
            for i, rec in enumerate(recs):
                present = [c for c in rec.clients if c not in before]
                cost = self._shard_cost(p, i, present, rec.rounds)
                total += cost
                if leaving & set(present):
                    affected += cost
        return total / affected if affected else float("inf")

    # -- unlearning -------------------------------------------------------------------------------

    def theoretical_speedup(self) -> float:
        """The paper's Proposition 1 approximation r1 = (R-1)/R * K/(K-1) * P."""
        k, r = self.num_clients, self.merge_rate
        return (r - 1) / r * k / (k - 1) * self.planned_stages

    def audit(self, tolerance: float) -> dict[str, Any]:
        """Replay the whole frozen tree without every unlearned client; compare every shard with the cache.

        The engine's half of ``audit`` (:func:`~.reference.certify` adds the independent reference
        and the verdict line); ``summary`` is what the verdict line says of it.
        """
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
        if not passed:  # the first shard off is where the difference starts; later stages inherit it
            first = next(d for d in per_shard if d["max_abs_diff"] > tolerance)
            lines.append(
                f"first difference: stage {first['stage']} shard {first['shard']} "
                f"(max|diff| = {first['max_abs_diff']:.3e})"
            )
        return {
            "passed": passed,
            "max_abs_diff": worst,
            "final_max_abs_diff": final,
            "shards": per_shard,
            "lines": lines,
            "summary": f"final model max|diff| = {final:.3e}, worst shard {worst:.3e}, tolerance {tolerance:.1e}; "
            f"unlearned clients {self.unlearned}; replay cost {steps} client-steps",
        }

    def reference_params(self) -> dict[str, Tensor] | None:
        """The independent reference: the frozen tree retrained without the unlearned clients.

        From the tree's record alone (children, clients, rounds, theta^0, the merge weights of
        the clients), not from the records' remaining clients and weights that unlearning keeps.
        """
        stages = [[TreeShard(r.children, r.clients, r.rounds) for r in recs] for recs in self.records]
        return ReferenceReplay(self.engine).tree(
            self.theta0, stages, set(self.unlearned), self._client_weight
        )
