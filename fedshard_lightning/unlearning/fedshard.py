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

FedShard is a :class:`~fedshard_lightning.unlearning.planner.Planner`: it says what each stage
trains and how the state changes; the trainer's loop runs the plans, commits FLCache after every
stage, counts the costs from the plans and records who was unlearned. Costs of a request, of a
retrain, and its latency are therefore those of the plans, for FedShard as for every method.

Departures from the paper, all from SPEC: alpha carries a sign from the principal residual
direction (section 4); A2 is the bounded, inverse-variance reading within [T0, T1] (section 5);
the tree shape and rounds are frozen metadata that were chosen with all clients present (section 7,
documented in docs/unlearning.md).
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine import Group, RoundInfo, TrainResult
from fedshard_lightning.engine.mix_rows import mix_rows
from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.flcache.cache import FLCache, StackWrite
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
    StageCosts,
    eq7_weights,
    expected_future_costs,
    flatten_update,
    num_stages,
    signed_angles,
    tree_client_costs,
)
from fedshard_lightning.sharding.round_rules import round_rule
from fedshard_lightning.unlearning.context import AlgorithmContext
from fedshard_lightning.unlearning.plan_state import PlanState, StageMerge, StagePlan, thaw
from fedshard_lightning.unlearning.planner import Planner
from fedshard_lightning.unlearning.reference import ReferenceReplay, TreeShard
from fedshard_lightning.unlearning.shard_state import ShardRecord

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


class FedShard(Planner):
    """Sharded FedAvg with exact unlearning, as a planner over the frozen tree.

    The state (:class:`~.plan_state.PlanState`) holds the tree, every stage's shard records and
    stacked shard models, the round policy's calibration and the shards changed since the last
    commit. A fit plan is one stage: the merge A1 chose, the rounds A2 gave, the children's
    averages as initial models (and, while A2 calibrates, a convergence stop). An unlearning
    request is one plan per stage on the leaving clients' paths, each starting from the
    re-averaged children that the plan before retrained.

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
            self._round_policy = rounds
        elif rounds == "a2":
            self._round_policy = A2Rounds(t0, t1)
        elif rounds == "fixed":
            self._round_policy = FixedRounds(fixed_rounds)
        elif rounds in ("auto", "stage_a2"):
            try:
                kind = AutoRounds if rounds == "auto" else StageA2Rounds
                self._round_policy = kind(tolerance=tolerance, patience=patience, max_rounds=max_rounds)
            except ConfigError as err:
                raise ConfigError(f"algorithm.{err}") from None
        else:
            raise ConfigError(
                f"algorithm.rounds={rounds!r}: choose auto, a2, stage_a2, fixed or a RoundPolicy class_path"
            )
        self.t0, self.t1, self.fixed_rounds = t0, t1, fixed_rounds
        self.merge_weighting = merge_weighting
        self._fresh_round_policy = self._round_policy.state_dict()
        self._sizes: list[int] = []
        self._steps: list[int] = []
        self._committed: tuple[str, str, dict[int, Mapping[str, Tensor]]] | None = None
        """(cache root, version, {stage: models}): the stage models that are the stacks of that
        committed version; the state's ``changed`` is relative to it."""

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

    # -- state ------------------------------------------------------------------------------------
    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """An empty tree over the K clients, no stage trained, the round policy uncalibrated."""
        return {
            "tree": ShardTree(self.num_clients, self.merge_rate),
            "records": (),
            "models": (),
            "round_policy": self._fresh_round_policy,
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

    def _now(self) -> PlanState | None:
        return self.__dict__.get("_state")

    @property
    def tree(self) -> ShardTree | None:
        """The frozen shard tree of the current state."""
        state = self._now()
        return None if state is None else state.tree

    @property
    def records(self) -> tuple[tuple[ShardRecord, ...], ...]:
        """Per trained stage, its shards' records (current state)."""
        state = self._now()
        return () if state is None else state.records

    @property
    def models(self) -> tuple[Mapping[str, Tensor], ...]:
        """Per trained stage, its shard models stacked ``[shards, ...]`` (current state)."""
        state = self._now()
        return () if state is None else state.models

    @property
    def changed(self) -> Mapping[int, Sequence[int] | None]:
        """Shards changed since the last commit: stage -> rows (None: a whole new stage)."""
        state = self._now()
        return {} if state is None else state.changed

    @property
    def round_policy(self) -> RoundPolicy:
        """The round policy with the current state's calibration (a copy: the state owns it)."""
        state = self._now()
        return self._policy(self._fresh_round_policy if state is None else state.round_policy)

    @round_policy.setter
    def round_policy(self, policy: RoundPolicy) -> None:
        """Configure another round policy (e.g. a calibration cap matched to a budget) before a fit."""
        self._round_policy = policy
        self._fresh_round_policy = policy.state_dict()

    def _policy(self, calibration: Mapping[str, Any]) -> RoundPolicy:
        policy = copy.deepcopy(self._round_policy)
        policy.load_state_dict(thaw(calibration))
        return policy

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
        theta0: Mapping[str, Tensor],
        stage: int,
        records: Sequence[ShardRecord],
        prev: Mapping[str, Tensor] | None,
        prev_records: Sequence[ShardRecord] | None,
        fresh: tuple[Sequence[int], Mapping[str, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """Initial models [N, ...] of the given shards of ``stage``: weighted average of their live children.

        ``fresh``: children retrained by this request, read from there (see :func:`.mix_rows`).
        """
        n = len(records)
        if stage == 1:
            return {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in theta0.items()}
        mixes = []
        for rec in records:
            live = [ch for ch in rec.children if not prev_records[ch].empty]
            total = sum(prev_records[ch].weight for ch in live)
            mixes.append([(ch, prev_records[ch].weight / max(total, 1e-300)) for ch in live])
        return mix_rows(prev, mixes, fresh)

    # -- the fit: one plan per stage ---------------------------------------------------------------
    def next_stage(self, state: PlanState) -> StagePlan | None:
        """Stage p+1 of the tree: A1's merge of stage p, A2's rounds, the children's averages."""
        stage = len(state.records) + 1
        if stage > self.planned_stages:
            return None
        policy = self._policy(state.round_policy)
        if stage == 1:
            prev_alpha = [0.0] * self.num_clients
            prev_counts = [1] * self.num_clients
            prev_weights = [self._client_weight(c) for c in range(self.num_clients)]
        else:
            prev_alpha = [r.alpha for r in state.records[-1]]
            prev_counts = [len(r.clients) for r in state.records[-1]]
            prev_weights = [r.weight for r in state.records[-1]]
        seed = self._merge_seed(stage)
        if self.merge_policy.needs_costs:
            costs = self._stage_costs(state, policy, stage)
            grouping = self.merge_policy.group(prev_alpha, prev_counts, self.merge_rate, seed, costs=costs)
        else:
            grouping = self.merge_policy.group(prev_alpha, prev_counts, self.merge_rate, seed)
        tree, shards = state.tree.with_stage(grouping)
        rounds = policy.rounds(stage, [[prev_alpha[c] for c in g] for g in grouping])
        records = tuple(
            ShardRecord(
                children=sh.children,
                clients=sh.clients,
                weight=float(sum(prev_weights[c] for c in sh.children)),
                alpha=0.0,
                rounds=int(rounds[i]),
                remaining=sh.clients,
            )
            for i, sh in enumerate(shards)
        )
        prev = state.models[-1] if state.models else None
        prev_records = state.records[-1] if state.records else None
        return StagePlan(
            stage,
            tuple(Group(i, tuple(r.clients), r.rounds) for i, r in enumerate(records)),
            self._children_average(state.theta0, stage, records, prev, prev_records),
            stop=_convergence_stop(policy, len(records)) if policy.calibrating(stage) else None,
            merge=StageMerge(grouping, prev_alpha, rounds),
            meta=_NewStage(tree, records),
        )

    def absorb(self, state: PlanState, plan: StagePlan, result: TrainResult) -> PlanState:
        """A fit stage: its models, rounds run, alphas (signed, SPEC 4); a request's stage: its retrained rows."""
        if isinstance(plan.meta, _Retrained):
            return self._absorb_retrained(state, plan, result)
        stage, init = plan.stage, plan.init
        records = [replace(rec, rounds=int(used)) for rec, used in zip(plan.meta.records, result.rounds_run)]
        names = [k for k in self.engine.names if k in result.params]  # SPEC 4: no BN statistics
        updates = flatten_update(
            {k: result.params[k] for k in names},
            {k: init[k] for k in names},
            stacked=True,
            dtype=torch.float64,
        )
        w = torch.tensor([r.weight for r in records], dtype=torch.float64, device=updates.device)
        alphas = signed_angles(updates, w) if len(records) > 1 else torch.zeros(1, dtype=torch.float64)
        calibration = state.round_policy
        if plan.stop is not None:  # A2's range is calibrated on the rounds these shards took
            policy = self._policy(calibration)
            policy.observe(stage, result.rounds_run)
            calibration = policy.state_dict()
        return state.replace(
            tree=plan.meta.tree,
            records=(
                *state.records,
                tuple(replace(r, alpha=float(a)) for r, a in zip(records, alphas.tolist())),
            ),
            models=(*state.models, result.params),
            round_policy=calibration,
            changed={**state.changed, stage: None},
        )

    def stage_report(
        self, state: PlanState, plan: StagePlan, result: TrainResult
    ) -> tuple[dict[str, float], dict[str, Tensor] | None]:
        """The stage's shards, mean |alpha| and rounds; theta^p (its live shards' average) to evaluate."""
        records = state.records[plan.stage - 1]
        alphas = torch.tensor([r.alpha for r in records], dtype=torch.float64)
        metrics = {
            "shards": float(len(records)),
            "mean_abs_alpha": float(alphas.abs().mean()),
            "rounds_min": float(min(r.rounds for r in records)),
            "rounds_max": float(max(r.rounds for r in records)),
        }
        return metrics, self._stage_average(state, plan.stage)

    def _stage_average(self, state: PlanState, stage: int) -> dict[str, Tensor]:
        """theta^p for the stage's test accuracy: the live shards weighted by their training samples.

        Sample weights, like the per-round accuracy (``fedshard_lightning.trainer.trainer``), so the per-round
        and per-stage curves describe the same model; the merge weights (``merge_weighting``)
        still decide how children are averaged into a shard's initial model.
        """
        recs, models = state.records[stage - 1], state.models[stage - 1]
        w = torch.tensor([float(sum(self._sizes[c] for c in r.remaining)) for r in recs], dtype=torch.float64)
        w = w / w.sum()
        return {k: (v * w.to(v).view(-1, *[1] * (v.ndim - 1))).sum(0) for k, v in models.items()}

    def current_params(self, state: PlanState) -> dict[str, Tensor]:
        """theta_1^P with every applied request."""
        return {k: v[0].clone() for k, v in state.models[-1].items()}

    # -- unlearning: the affected shards, stage by stage ---------------------------------------------
    def plan_unlearn(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """Retrain only the shards whose remaining clients meet ``clients``, bottom-up."""
        leaving = {int(c) for c in clients}
        affected = {
            p: [i for i, r in enumerate(recs) if leaving & set(r.remaining)]
            for p, recs in enumerate(state.records, start=1)
        }
        return self._replay_plans(state, {*state.unlearned, *leaving}, affected)

    def plan_retrain(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """Every shard of the frozen tree without ``clients`` and the unlearned (SPEC 7: the tree stays)."""
        return self._replay_plans(state, {*state.unlearned, *(int(c) for c in clients)}, None)

    def replay_state(self, state: PlanState) -> tuple[PlanState, int]:
        """The frozen tree replayed from theta^0 without every unlearned client (what ``audit`` compares)."""
        plans = self.checked.plan_retrain(state, ())
        results = self.run_plans(plans)
        reference = state
        for plan, result in zip(plans, results):
            reference = self.checked.absorb(reference, plan, result)
        return reference, sum(r.client_steps for r in results)

    def _replay_plans(
        self, state: PlanState, gone: set[int], only: dict[int, list[int]] | None
    ) -> list[StagePlan]:
        """Plans that recompute shards bottom-up without ``gone``: the listed ones (``only``) or all of them.

        The shards, their remaining clients and rounds follow from the frozen tree before any
        training; each stage starts from the re-averaged models of its children, those retrained
        by the plan of the stage before read from its result.
        """
        if len(gone) >= self.num_clients:
            raise ConfigError(
                f"clients: unlearning {sorted(gone)} would leave no client to train the tree; keep at least one"
            )
        records = [list(recs) for recs in state.records]  # a record is copied where it changes
        jobs: list[tuple[int, list[int]]] = []
        for p, (weights, hit) in enumerate(self._live_shards(state.tree, len(records), gone), start=1):
            recs = records[p - 1]
            for i, rec in enumerate(recs):
                remaining, weight = hit.get(i, rec.clients), weights[i]
                if remaining != rec.remaining or weight != rec.weight:
                    recs[i] = replace(rec, remaining=remaining, weight=weight)
            idx = [
                i for i in range(len(recs)) if (only is None or i in only.get(p, ())) and not recs[i].empty
            ]
            if idx:
                jobs.append((p, idx))
        frozen = tuple(tuple(recs) for recs in records)
        theta0, models = state.theta0, state.models
        plans = []
        for j, (p, idx) in enumerate(jobs):
            before = j - 1 if j and jobs[j - 1][0] == p - 1 else None  # the plan that retrained the children

            def init(
                results: Sequence[TrainResult], p: int = p, idx: list[int] = idx, before: int | None = before
            ) -> dict[str, Tensor]:
                sub = [frozen[p - 1][i] for i in idx]
                if p == 1:
                    return self._children_average(theta0, 1, sub, None, None)
                fresh = None if before is None else (jobs[before][1], results[before].params)
                return self._children_average(theta0, p, sub, models[p - 2], frozen[p - 2], fresh)

            groups = tuple(Group(i, tuple(frozen[p - 1][i].remaining), frozen[p - 1][i].rounds) for i in idx)
            plans.append(StagePlan(p, groups, init, meta=_Retrained(frozen, tuple(idx))))
        return plans

    def _absorb_retrained(self, state: PlanState, plan: StagePlan, result: TrainResult) -> PlanState:
        """The retrained shards' rows into their stage; the records without the unlearned clients."""
        p, idx = plan.stage, list(plan.meta.shards)
        idx_t = torch.as_tensor(idx, device=next(iter(result.params.values())).device)
        models = list(state.models)  # a stage's models are replaced, never written to
        models[p - 1] = {k: v.index_copy(0, idx_t, result.params[k]) for k, v in models[p - 1].items()}
        changed = dict(state.changed)
        if p not in changed or changed[p] is not None:
            changed[p] = tuple(sorted({*changed.get(p, ()), *idx}))
        if state.records is not plan.meta.records:  # the request's records, once per request
            return state.replace(models=tuple(models), records=plan.meta.records, changed=changed)
        return state.replace(models=tuple(models), changed=changed)

    def unlearn_details(
        self, state: PlanState, new: PlanState, clients: Sequence[int], plans: Sequence[StagePlan]
    ) -> dict[str, Any]:
        """The retrained and emptied shards, the paper's r1 and the speed-up counting the leaving clients."""
        emptied = [
            (p, i) for p, recs in enumerate(new.records, start=1) for i, r in enumerate(recs) if r.empty
        ]
        return {
            "retrained_shards": [
                {"stage": plan.stage, "shard": g.key} for plan in plans for g in plan.groups
            ],
            "empty_shards": [{"stage": p, "shard": i} for p, i in emptied],
            "theoretical_r1": self.theoretical_speedup(),
            "speedup_client_steps_counting_leaving": self.ratio_counting_leaving(state, clients),
        }

    def _live_shards(
        self, tree: ShardTree, stages: int, gone: Iterable[int]
    ) -> list[tuple[list[float], dict[int, tuple[int, ...]]]]:
        """Per stage: the shards' merge weights without ``gone``, and who remains where it hit.

        Merge weights are integer-valued (1 per client, or its sample count), so the tree's
        vectorized sums give the bits of a sum over the records.
        """
        w = (
            np.ones(self.num_clients)
            if self.merge_weighting == "clients"
            else np.asarray(self._sizes, np.float64)
        )
        return tree.live_shards(w, gone, stages)

    # -- costs: A1's cost model and the paper's r1 (the request's costs are its plans') --------------
    def _stage_costs(self, state: PlanState, policy: RoundPolicy, stage: int) -> StageCosts:
        """A1's cost model for ``stage``: costs paid in the trained stages, expected rounds and later costs.

        From stage 2 on, every client weighs ``1 / |alpha|`` of its stage-1 shard (paper eq. 7, SPEC
        section 5); a policy that wants uniform weights drops them (``A1Merge(weighting="uniform")``).
        """
        planned, records = self.planned_stages, state.records
        if stage == 1:
            children = [[c] for c in range(self.num_clients)]
        else:
            children = [list(r.clients) for r in records[-1]]
        paid = tree_client_costs([[(r.clients, r.rounds) for r in recs] for recs in records], self._steps)
        later_shards, later_rounds, n = [], [], -(-len(children) // self.merge_rate)
        for p in range(stage + 1, planned + 1):
            n = -(-n // self.merge_rate)
            later_shards.append(n)
            later_rounds.append(policy.expected_rounds(p, last=p == planned))
        return StageCosts(
            shard_clients=children,
            client_steps=self._steps,
            paid=paid,
            rounds=policy.expected_rounds(stage, last=stage == planned),
            future=expected_future_costs(self._steps, later_shards, later_rounds),
            weights=eq7_weights(
                [r.clients for r in records[0]], [r.alpha for r in records[0]], self.num_clients
            )
            if records
            else None,
            rounds_fn=None
            if policy.calibrating(stage)
            else lambda children_alphas: policy.rounds(stage, children_alphas),
            rounds_rule=round_rule(policy, stage),  # None while calibrating
        )

    def ratio_counting_leaving(self, state: PlanState, clients: Sequence[int]) -> float:
        """The paper's r1 measured: the leaving clients' own steps counted on both sides.

        Proposition 1 divides the training of the whole tree (``T_train = P T K``, every client
        counted) by the retraining of the affected shards *with* their full client counts
        (``T_un = sum_p T R^p``). The trainer's ``speedup_client_steps`` (retrain / predicted
        cost) leaves the leaving clients out of both sides instead. With fixed rounds, equal
        client sizes and ``K = R**P`` this equals :meth:`theoretical_speedup` exactly.
        """
        before, leaving = set(state.unlearned), set(clients)
        total = affected = 0
        for p, recs in enumerate(state.records, start=1):
            for i, rec in enumerate(recs):
                present = [c for c in rec.clients if c not in before]
                cost = self.group_cost(p, Group(i, tuple(present), rec.rounds))
                total += cost
                if leaving & set(present):
                    affected += cost
        return total / affected if affected else float("inf")

    def theoretical_speedup(self) -> float:
        """The paper's Proposition 1 approximation r1 = (R-1)/R * K/(K-1) * P."""
        k, r = self.num_clients, self.merge_rate
        return (r - 1) / r * k / (k - 1) * self.planned_stages

    # -- certificate ----------------------------------------------------------------------------------
    def audit_compare(
        self, state: PlanState, reference: PlanState, tolerance: float, steps: int
    ) -> dict[str, Any]:
        """Every live shard of every stage compared with its replay; the first one off is named."""
        lines, worst, per_shard = [], 0.0, []
        for p, (mine, ref, recs) in enumerate(
            zip(state.models, reference.models, reference.records), start=1
        ):
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
        last, ref_last = state.models[-1], reference.models[-1]
        final = max(float((last[k][0] - ref_last[k][0]).abs().max()) for k in last)
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
            f"unlearned clients {list(state.unlearned)}; replay cost {steps} client-steps",
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

    # -- cache: FLCache format 2 --------------------------------------------------------------------
    def _structure(self, records: Sequence[ShardRecord]) -> dict[str, Tensor]:
        """The frozen metadata of a stage's shards: children (in aggregation order), alpha, rounds.

        It never changes after the stage is trained, so its blob is written once per run and every
        later version shares it.
        """
        lengths = torch.tensor([len(r.children) for r in records], dtype=torch.int64)
        return {
            "children": torch.tensor([c for r in records for c in r.children], dtype=torch.int64),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "alpha": torch.tensor([r.alpha for r in records], dtype=torch.float64),
            "rounds": torch.tensor([r.rounds for r in records], dtype=torch.int64),
        }

    def cache_files(
        self, cache: FLCache
    ) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """The stage count, the client sizes, the round calibration and every stage's frozen structure.

        Clients, remaining clients and weights are not stored: they follow from the tree, the
        unlearned clients and the client weights.
        """
        state = self.state
        fields = {
            "merge_rate": self.merge_rate,
            "planned_stages": self.planned_stages,
            "stages_done": len(state.records),
            "round_policy_state": thaw(state.round_policy),
        }
        tensors = {"client_sizes.safetensors": {"sizes": torch.tensor(self._sizes, dtype=torch.int64)}}
        for p, recs in enumerate(state.records, start=1):
            tensors[f"structure_{p}.safetensors"] = self._structure(recs)
        return fields, tensors, {}

    def cache_stacks(self, cache: FLCache) -> dict[str, StackWrite]:
        """One stack per stage (one blob per shard model); only rows changed since the committed version.

        A stage whose tensors are the very objects of the last committed version writes nothing;
        when the state did not come from the cache's current version, every row is hashed and only
        missing blobs are written (content addressing makes the result the same either way).
        """
        committed, state = self._committed, self.state
        clean = (
            committed is not None
            and cache.exists()
            and committed[0] == str(cache.root)
            and committed[1] == cache.current()
        )
        stacks = {}
        for p, m in enumerate(state.models, start=1):
            rows: list[int] | None = None
            if clean:
                before = committed[2].get(p)
                if _same_tensors(before, m):
                    rows = []
                elif before is not None:
                    rows = None if state.changed.get(p) is None else list(state.changed[p])
            stacks[f"stage_{p}"] = StackWrite(dict(m), rows)
        return stacks

    def committed(self, cache: FLCache, version: str) -> None:
        """The current stage models are the stacks of ``version``; nothing has changed since."""
        state = self.state
        self._committed = (str(cache.root), version, dict(enumerate(state.models, start=1)))
        self.__dict__["_state"] = state._with({"changed": {}})

    def _records_from(
        self, tree: ShardTree, structures: list[dict[str, Tensor]], gone: set[int]
    ) -> tuple[tuple[ShardRecord, ...], ...]:
        """Records of every stage from the frozen structure, the tree and the unlearned clients.

        A record's client tuples come from one ``tolist`` of its stage, and the shards that no
        unlearned client touched share one tuple for clients and remaining.
        """
        records = []
        for p, (st, (weights, hit)) in enumerate(
            zip(structures, self._live_shards(tree, len(structures), gone)), start=1
        ):
            alpha, rounds = st["alpha"].tolist(), st["rounds"].tolist()
            a = tree.stage_arrays(p)
            if len(alpha) != a.size or len(rounds) != a.size:
                raise ValueError(f"structure of stage {p}: {len(alpha)} shards, the tree has {a.size}")
            ids, cs = a.clients.tolist(), a.client_starts.tolist()
            kids, ks = a.children.tolist(), a.child_starts.tolist()
            recs = []
            for i in range(a.size):
                clients = tuple(ids[cs[i] : cs[i + 1]])
                children = tuple(kids[ks[i] : ks[i + 1]])
                recs.append(
                    ShardRecord(children, clients, weights[i], alpha[i], int(rounds[i]), hit.get(i, clients))
                )
            records.append(tuple(recs))
        return tuple(records)

    def restore_cache(self, cache: FLCache, manifest: dict[str, Any], device: torch.device) -> None:
        """The tree and the records from the frozen structure, every stage's shard models, the calibration."""
        version = cache.current()
        if manifest.get("merge_rate") != self.merge_rate:
            raise CacheError(f"{cache.root}: the cache was made for another number of clients or merge rate")
        stages = manifest.get("stages_done")
        if isinstance(stages, bool) or not isinstance(stages, int) or not 0 <= stages <= self.planned_stages:
            raise CacheError(f"{cache.root}: the manifest's stage count {stages!r} is malformed")
        structures = [
            cache.tensors(f"structure_{p}.safetensors", version=version, manifest=manifest)
            for p in range(1, stages + 1)
        ]
        gone = {int(c) for c in manifest.get("unlearned", [])}
        try:
            with _gc_paused():
                arrays = [(st["children"].numpy(), st["offsets"].numpy()) for st in structures]
                tree = ShardTree.from_arrays(self.num_clients, self.merge_rate, arrays)
                records = self._records_from(tree, structures, gone)
        except (KeyError, TypeError, ValueError) as e:
            raise CacheError(f"{cache.root}: the cached tree is malformed ({e})") from None
        models = tuple(
            cache.stack(f"stage_{p}", version=version, device=device, manifest=manifest)
            for p in range(1, stages + 1)
        )
        calibration = manifest.get("round_policy_state", self._fresh_round_policy)
        self.__dict__["_state"] = self.state._with(
            {"tree": tree, "records": records, "models": models, "round_policy": calibration, "changed": {}}
        )
        self.committed(cache, version)

    def resumable(self, manifest: dict[str, Any]) -> bool:
        """A partial fit continues after its last complete stage."""
        return manifest.get("stages_done") is not None


@dataclass(frozen=True)
class _NewStage:
    """A fit plan's tree with the new stage, and the stage's records before training."""

    tree: ShardTree
    records: tuple[ShardRecord, ...]


@dataclass(frozen=True)
class _Retrained:
    """A request's plan: every stage's records without the leaving clients, and the shards it retrains."""

    records: tuple[tuple[ShardRecord, ...], ...]
    shards: tuple[int, ...]


def _convergence_stop(policy: RoundPolicy, groups: int) -> Callable[[], Callable[..., list[bool]]]:
    """A factory of A2's calibration hook: a shard stops once its loss stops improving (Appendix D.3)."""

    def factory() -> Callable[[RoundInfo, dict[str, Tensor]], list[bool]]:
        tracker = policy.make_tracker(groups)
        last: list[float | None] = [None] * groups  # under DDP a rank sees only its shards

        def on_round(info: RoundInfo, state: dict[str, Tensor]) -> list[bool]:
            for pos, loss in zip(info.active, info.mean_loss):
                last[pos] = loss
            return tracker.update(last)

        return on_round

    return factory


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic GC while ~K records and their tuples are built.

    They all stay alive, so each collection would rescan the whole heap for nothing (0.55 s
    of CPU instead of 0.16 s for the tree and records at K = 65,536).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _same_tensors(a: Any, b: Any) -> bool:
    """The same tensor objects under the same names."""
    return (
        isinstance(a, Mapping)
        and isinstance(b, Mapping)
        and a.keys() == b.keys()
        and all(a[k] is b[k] for k in a)
    )
