"""FedShard: sharded federated learning with exact, fair and fast federated unlearning.

Paper: *FedShard: Federated Unlearning with Efficiency Fairness and Performance Fairness*
(Ding et al.): Algorithm 1 "FedShard Federated Learning", Algorithm 2 "FedShard Federated
Unlearning", Appendix D; made precise by SPEC sections 2, 4-7 (``docs/spec.md``).

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

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor

from fedshard_lightning.engine import Group, RoundInfo, TrainResult
from fedshard_lightning.engine.mix_rows import mix_rows
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.limits import check_count
from fedshard_lightning.sharding import (
    A1Merge,
    A2Rounds,
    AutoRounds,
    FixedRounds,
    MergePolicy,
    RandomMerge,
    RoundPolicy,
    ShardTree,
    StageA2Rounds,
    flatten_update,
    num_stages,
    signed_angles,
)
from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult
from fedshard_lightning.unlearning.context import AlgorithmContext
from fedshard_lightning.unlearning.shard_costs import ShardCosts
from fedshard_lightning.unlearning.shard_state import ShardCache, ShardRecord

__all__ = ["FedShard", "ShardRecord"]


def _merge_policy(merge: str | MergePolicy) -> MergePolicy:
    a1 = {
        "a1": {},
        "a1_cost": {"random_start": False, "refine": True, "weighting": "uniform"},
        "a1_path": {"random_start": False, "refine": True, "weighting": "uniform", "shared_rounds": True},
        "a1_count": {"allocation": "count"},
    }
    if isinstance(merge, MergePolicy):
        return merge
    if merge in a1:
        return A1Merge(**a1[merge])
    if merge == "random":
        return RandomMerge()
    raise ConfigError(
        f"algorithm.merge={merge!r}: choose a1, a1_cost, a1_path, a1_count, random or a MergePolicy class_path"
    )


class FedShard(ShardCosts, ShardCache, Algorithm):
    """Sharded FedAvg with exact unlearning.

    Args:
        merge_rate: R, children per merged shard (>= 2).
        merge: ``a1`` (the paper's A1 as SPEC section 5 states it: stage 1 at random, then
            direction-balanced merging whose ``allocateChildShard`` picks the child of lowest eq. 7
            M_e, ``1 / |alpha_c|`` weights, of the predicted unlearning costs; no further pass),
            ``a1_cost`` (our variant: stage 1 filled by the costs too, uniform weights, swap
            refinement under known rounds), ``a1_path`` (our variant for ``rounds: stage_a2``:
            ``a1_cost`` that also refines the calibration stages under the stage's shared expected
            rounds, so every stage balances each client's whole path cost), ``a1_count`` (A1
            balancing client counts, the first
            implementation), ``random`` (naive sharding) or a
            :class:`~fedshard_lightning.sharding.MergePolicy`.
        rounds: ``auto`` (the paper, Appendix D.3: stages 1-2 train to convergence, the fewest and
            most rounds seen become [T0, T1] of A2 for the later stages), ``a2`` (A2 within a
            hand-set [t0, t1]), ``stage_a2`` (our variant: A2's rule over whole stages, every shard
            of a stage the same rounds, :class:`~fedshard_lightning.sharding.StageA2Rounds`),
            ``fixed`` (``fixed_rounds`` everywhere), or a
            :class:`~fedshard_lightning.sharding.RoundPolicy`.
        t0: Fewest rounds of ``a2``.
        t1: Most rounds of ``a2`` (also the rounds of stage 1 and of the last stage, SPEC section 5).
        fixed_rounds: Rounds per shard for ``rounds: fixed``.
        max_rounds: ``auto``: cap on the rounds of a shard trained to convergence.
        tolerance: ``auto``: relative loss improvement below which a round counts as none.
        patience: ``auto``: rounds without improvement after which a shard has converged.
        merge_weighting: Aggregation weight of a client: ``clients`` (1 per client, the paper) or
            ``samples`` (its number of training samples).
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    local_bn_ok = True  # one engine call per stage

    name = "fedshard"
    state_fields = (*Algorithm.state_fields, "tree", "records", "models", "stage_seconds", "changed")

    def __init__(
        self,
        merge_rate: int = 2,
        merge: Literal["a1", "a1_cost", "a1_path", "a1_count", "random"] | MergePolicy = "a1",
        rounds: Literal["auto", "a2", "stage_a2", "fixed"] | RoundPolicy = "auto",
        t0: int = 2,
        t1: int = 8,
        fixed_rounds: int = 5,
        max_rounds: int = 30,
        tolerance: float = 1e-3,
        patience: int = 2,
        merge_weighting: Literal["clients", "samples"] = "clients",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(merge_rate, bool) or not isinstance(merge_rate, int) or merge_rate < 2:
            raise ConfigError(f"algorithm.merge_rate={merge_rate!r}: must be an integer >= 2")
        if merge_weighting not in ("clients", "samples"):
            raise ConfigError(f"algorithm.merge_weighting={merge_weighting!r}: choose clients or samples")
        check_count("algorithm.fixed_rounds", fixed_rounds)
        check_count("algorithm.t0", t0, what=" (the fewest rounds a shard trains)")
        check_count("algorithm.t1", t1, what=" (the most rounds a shard trains)")
        if t0 > t1:
            raise ConfigError(f"algorithm.t0={t0!r}, algorithm.t1={t1!r}: need integers with 1 <= t0 <= t1")
        self.merge_rate = merge_rate
        self.merge_policy = _merge_policy(merge)
        self._choices = (
            merge if isinstance(merge, str) else type(merge).__name__,
            rounds if isinstance(rounds, str) else type(rounds).__name__,
        )
        if isinstance(rounds, RoundPolicy):
            self.round_policy = rounds
        elif rounds == "a2":
            self.round_policy = A2Rounds(t0, t1)
        elif rounds == "fixed":
            self.round_policy = FixedRounds(fixed_rounds)
        elif rounds in ("auto", "stage_a2"):
            try:
                kind = AutoRounds if rounds == "auto" else StageA2Rounds
                self.round_policy = kind(tolerance=tolerance, patience=patience, max_rounds=max_rounds)
            except ConfigError as err:
                raise ConfigError(f"algorithm.{err}") from None
        else:
            raise ConfigError(
                f"algorithm.rounds={rounds!r}: choose auto, a2, stage_a2, fixed or a RoundPolicy class_path"
            )
        self.t0, self.t1, self.fixed_rounds = t0, t1, fixed_rounds
        self.merge_weighting = merge_weighting
        self._fresh_round_policy = self.round_policy.state_dict()
        self.tree: ShardTree | None = None
        self.records: list[list[ShardRecord]] = []
        self.models: list[dict[str, Tensor]] = []
        self.stage_seconds: list[float] = []
        self._sizes: list[int] = []
        self._steps: list[int] = []
        self.changed: dict[int, list[int] | None] = {}  # see ShardCache

    @property
    def variant(self) -> str:
        """Which of our departures from the paper this instance runs (empty for the paper's A1 + auto A2).

        Comparisons label a row with it, so the paper's FedShard and a variant can stand side by side.
        """
        merge, rounds = self._choices
        parts = [f"merge: {merge}"] if merge != "a1" else []
        parts += [f"rounds: {rounds}"] if rounds != "auto" else []
        return ", ".join(parts)

    def setup(self, ctx: AlgorithmContext) -> None:
        """Build the engine; remember every client's sample count and local steps per round."""
        if len(ctx.client_sizes) < 2:  # the tree needs something to merge; FedAvg takes one client
            raise ConfigError(f"data.num_clients={len(ctx.client_sizes)}: FedShard needs 2 or more clients")
        super().setup(ctx)
        self._sizes = [int(n) for n in ctx.client_sizes]
        self._steps = [self.schedule.num_steps(n) for n in self._sizes]

    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """An empty tree over the K clients; the round policy forgets any earlier calibration."""
        self.round_policy.load_state_dict(self._fresh_round_policy)
        return {
            **super().initial_state(theta0),
            "tree": ShardTree(self.num_clients, self.merge_rate),
            "records": [],
            "models": [],
            "stage_seconds": [],
            "changed": {},
        }

    def reset(self, theta0: dict[str, Tensor], exclude: Sequence[int] = ()) -> None:
        """A fresh fit; the tree always holds every client, so excluding some up front is refused."""
        if exclude:
            raise ConfigError(
                f"exclude_clients={sorted(exclude)}: FedShard builds its tree with every client; fit with all "
                "of them and unlearn these afterwards (audit then checks the result)"
            )
        super().reset(theta0)

    def is_complete(self) -> bool:
        """Every planned stage is trained."""
        return len(self.records) == self.planned_stages

    def progress(self) -> str:
        """Stages trained so far."""
        return f"training stopped after stage {len(self.records)} of {self.planned_stages}"

    def run_files(self) -> dict[str, str]:
        """``tree.txt``: the frozen tree, drawn."""
        return {"tree.txt": self.tree.pretty() + "\n"}

    @property
    def planned_stages(self) -> int:
        """P, the number of stages for K clients at rate R."""
        return num_stages(self.num_clients, self.merge_rate)

    def _client_weight(self, c: int) -> float:
        return 1.0 if self.merge_weighting == "clients" else float(self._sizes[c])

    def _merge_seed(self, stage: int) -> int:
        return (self.ctx.seed * 1_000_003 + stage * 7919) % (2**32)

    def _children_average(
        self,
        stage: int,
        records: Sequence[ShardRecord],
        prev: dict[str, Tensor] | None,
        prev_records: Sequence[ShardRecord] | None,
        fresh: tuple[Sequence[int], dict[str, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """Initial models [N, ...] of the given shards of ``stage``: weighted average of their live children.

        ``fresh``: children retrained by this request, read from there (see :func:`.mix_rows`).
        """
        n = len(records)
        if stage == 1:
            return {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in self.theta0.items()}
        mixes = []
        for rec in records:
            live = [ch for ch in rec.children if not prev_records[ch].empty]
            total = sum(prev_records[ch].weight for ch in live)
            mixes.append([(ch, prev_records[ch].weight / max(total, 1e-300)) for ch in live])
        return mix_rows(prev, mixes, fresh)

    def _train_stage(
        self, stage: int, init: dict[str, Tensor], groups: list[Group], report: bool
    ) -> TrainResult:
        tracker = None
        if report and self.round_policy.calibrating(stage):
            tracker = self.round_policy.make_tracker(len(groups))
            last: list[float | None] = [None] * len(groups)  # under DDP a rank sees only its shards

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
        """Stages after the last trained one (all of them from a fresh state); returns theta_1^P."""
        events = self.events
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
            if self.merge_policy.needs_costs:
                grouping = self.merge_policy.group(
                    prev_alpha,
                    prev_counts,
                    self.merge_rate,
                    self._merge_seed(stage),
                    costs=self._stage_costs(stage),
                )
            else:
                grouping = self.merge_policy.group(
                    prev_alpha, prev_counts, self.merge_rate, self._merge_seed(stage)
                )
            shards = self.tree.add_stage(grouping)
            children_alphas = [[prev_alpha[c] for c in g] for g in grouping]
            rounds = self.round_policy.rounds(stage, children_alphas)
            records = [
                ShardRecord(
                    children=sh.children,
                    clients=sh.clients,
                    weight=float(sum(prev_weights[c] for c in sh.children)),
                    alpha=0.0,
                    rounds=int(rounds[i]),
                    remaining=sh.clients,
                )
                for i, sh in enumerate(shards)
            ]
            events.stage_merge(stage, grouping, prev_alpha, rounds)
            groups = [Group(i, tuple(r.clients), r.rounds) for i, r in enumerate(records)]
            events.stage_start(stage, groups)
            prev = self.models[-1] if self.models else None
            prev_rec = self.records[-1] if self.records else None
            init = self._children_average(stage, records, prev, prev_rec)
            res = self._train_stage(stage, init, groups, report=True)
            for rec, used in zip(records, res.rounds_run):
                rec.rounds = int(used)
            names = [k for k in self.engine.names if k in res.params]  # SPEC 4: no BN statistics
            updates = flatten_update(
                {k: res.params[k] for k in names},
                {k: init[k] for k in names},
                stacked=True,
                dtype=torch.float64,
            )
            w = torch.tensor([r.weight for r in records], dtype=torch.float64, device=updates.device)
            alphas = signed_angles(updates, w) if len(records) > 1 else torch.zeros(1, dtype=torch.float64)
            for rec, a in zip(records, alphas.tolist()):
                rec.alpha = float(a)
            self.records.append(records)
            self.models.append(res.params)
            self.mark_changed(new_stage=stage)
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
            acc, loss = events.evaluate(self._stage_average(stage))
            stage_metrics.update(test_accuracy=acc, test_loss=loss)
            events.stage_end(stage, stage_metrics)
        return self.current_params()

    def _stage_average(self, stage: int) -> dict[str, Tensor]:
        """theta^p for the stage's test accuracy: the live shards weighted by their training samples.

        Sample weights, like the per-round accuracy (``fedshard_lightning.trainer.trainer``), so the per-round
        and per-stage curves describe the same model; the merge weights (``merge_weighting``)
        still decide how children are averaged into a shard's initial model.
        """
        recs = self.records[stage - 1]
        models = self.models[stage - 1]
        w = torch.tensor([float(sum(self._sizes[c] for c in r.remaining)) for r in recs], dtype=torch.float64)
        w = w / w.sum()
        return {k: (v * w.to(v).view(-1, *[1] * (v.ndim - 1))).sum(0) for k, v in models.items()}

    def current_params(self) -> dict[str, Tensor]:
        """theta_1^P with every applied request."""
        return {k: v[0].clone() for k, v in self.models[-1].items()}

    # -- costs ------------------------------------------------------------------------------------
    def _replay(self, gone: set[int], only: dict[int, list[int]] | None) -> tuple[list, list, int, list]:
        """Recompute shards bottom-up without ``gone``: the listed ones (``only``) or all of them.

        The shards to retrain and their rounds follow from the frozen tree before any training, so
        the whole replay is one engine call (:meth:`train_stages`); each stage starts from the
        re-averaged models of its children, retrained by the stage before.
        """
        records = [list(recs) for recs in self.records]  # a record is copied where it changes
        models = list(self.models)  # a stage's models are replaced, never written to
        jobs: list[tuple[int, list[Group]]] = []
        shards: list[list[int]] = []
        for p, (weights, hit) in enumerate(self.live_shards(len(records), gone), start=1):
            recs = records[p - 1]
            for i, rec in enumerate(recs):
                remaining, weight = hit.get(i, rec.clients), weights[i]
                if remaining != rec.remaining or weight != rec.weight:
                    recs[i] = replace(rec, remaining=remaining, weight=weight)
            idx = [
                i for i in range(len(recs)) if (only is None or i in only.get(p, ())) and not recs[i].empty
            ]
            if idx:
                jobs.append((p, [Group(i, tuple(recs[i].remaining), recs[i].rounds) for i in idx]))
                shards.append(idx)
        fresh: dict[int, tuple[list[int], dict[str, Tensor]]] = {}  # stage -> retrained shards, models

        def init_of(j: int, results: list[TrainResult]) -> dict[str, Tensor]:
            if j:  # read from the results: no copy of a whole stage between two trainings
                fresh[jobs[j - 1][0]] = (shards[j - 1], results[j - 1].params)
            p = jobs[j][0]
            sub = [records[p - 1][i] for i in shards[j]]
            if p == 1:
                return self._children_average(p, sub, None, None)
            return self._children_average(p, sub, models[p - 2], records[p - 2], fresh.get(p - 1))

        results = self.train_stages(jobs, init_of)
        for (p, _), idx, res in zip(jobs, shards, results):  # the retrained shards into their stages
            idx_t = torch.as_tensor(idx, device=next(iter(res.params.values())).device)
            models[p - 1] = {k: v.index_copy(0, idx_t, res.params[k]) for k, v in models[p - 1].items()}
        retrained = [(p, i) for (p, _), idx in zip(jobs, shards) for i in idx]
        return records, models, sum(r.client_steps for r in results), retrained

    def unlearn(self, clients: Sequence[int]) -> UnlearnResult:
        """Retrain only the shards whose clients meet ``clients``, stage by stage."""
        plan = self._plan(clients)
        predicted = self.predict_cost(clients)
        retrain = self.retrain_cost(clients)
        ratio_with_leaving = self.ratio_counting_leaving(clients)
        gone = set(self.unlearned) | set(clients)
        t = time.perf_counter()
        records, models, steps, retrained = self._replay(gone, plan)
        seconds = time.perf_counter() - t
        self.records, self.models = records, models
        self.unlearned = sorted(gone)
        self.mark_changed(retrained)
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
                "speedup_client_steps_counting_leaving": ratio_with_leaving,
            },
        )
