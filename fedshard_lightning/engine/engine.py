"""The engine: FedAvg of many groups of clients at once (SPEC sections 2-3).

"Train these groups, each from its initial model, over its clients, for its number of rounds."
Every algorithm (FedShard's stages, plain FedAvg, the unlearning baselines) is built on
:meth:`FederatedEngine.train_groups`; none writes its own training loop. In each round the
participants of all still-active groups train together (stacked, in memory-sized chunks), then
each group averages its participants weighted by their sample counts.

``train_groups`` is one loop (:func:`.driver.drive`) whatever path it takes: it picks the round
runner, :class:`_GeneralRounds` (here) or the lean :class:`.lean_rounds.LeanRounds`, and the
driver does the rest, so both paths count, record and stop alike.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.engine.aggregate import GroupSums, SumLayout
from fedshard_lightning.engine.driver import drive
from fedshard_lightning.engine.fixed_blocks import train_in_blocks
from fedshard_lightning.engine.grad_clip import grad_clip
from fedshard_lightning.engine.groups import (
    Group,
    RoundInfo,
    TrainResult,
    add_logged,
    check_finite,
    one_sample_batchnorm,
    stack_params,
    unstack_params,
)
from fedshard_lightning.engine.lean_rounds import LeanRounds, lean_eligible
from fedshard_lightning.engine.local import ClientBatch, LocalResult, LocalTrainer, NotVectorizable
from fedshard_lightning.engine.local_layers import LocalLayers
from fedshard_lightning.engine.optim import OptimizerSpec, optimizer_spec
from fedshard_lightning.engine.participants import KeyedSampling, ParticipantPolicy
from fedshard_lightning.engine.path_choice import check_agreement, choose_path, first_round_sample
from fedshard_lightning.engine.ranks import Ranks, RoundRecorder
from fedshard_lightning.engine.round_plan import RoundPlan
from fedshard_lightning.engine.schedule import LocalSchedule
from fedshard_lightning.engine.stages import train_stages
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.module import client_buffer_names

__all__ = [
    "FederatedEngine",
    "Group",
    "RoundInfo",
    "TrainResult",
    "client_buffer_names",
    "stack_params",
    "unstack_params",
]

Vectorize = Literal["auto", "always", "never"]


class FederatedEngine:
    """Vectorized FedAvg over groups, with a per-client loop of the same math as reference.

    Args:
        module: The user's model (a :class:`~fedshard_lightning.module.FederatedModule`), already
            on its device and dtype.
        datamodule: The set-up datamodule; its tensors on the module's device.
        schedule: Batch size and local epochs/steps.
        seed: Training seed of the keyed randomness.
        client_fraction: Share of a group's clients sampled (without replacement) in each round.
        vectorize: ``always`` (stacked), ``never`` (per-client loop) or ``auto`` (time both once on
            this model and device, keep the faster).
        max_chunk_clients: Clients trained together at most; ``None`` derives it from the budget.
        memory_budget_mb: Memory the stacked clients of one chunk may use (an estimate).
        batch_invariant: Compute every client with the same kernel shapes whoever shares its
            chunk (see :meth:`invariant_block`), so float32 unlearning replays bit for bit.
        compile: ``torch.compile`` the stacked step (the chain kernel or the fx program; vmap
            stays eager). Shapes are then fixed per call, so each shape compiles once.
        gradient_clip_val: Clip each client's gradients to this norm (or value); None: no clipping.
        gradient_clip_algorithm: ``norm`` or ``value`` (:mod:`.grad_clip`).
        optimizer_state: ``reset`` (a fresh client optimizer every round) or ``keep`` (each client's
            optimizer state carried from its last round to its next, within one :meth:`train_groups`
            call, so a retrained stage replays it from the stage's start; on the per-client loop).
    """

    def __init__(
        self,
        module: nn.Module,
        datamodule: FederatedDataModule,
        schedule: LocalSchedule,
        seed: int = 0,
        client_fraction: float = 1.0,
        vectorize: Vectorize = "auto",
        max_chunk_clients: int | None = None,
        memory_budget_mb: float = 2048.0,
        batch_invariant: bool = True,
        compile: bool = False,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        optimizer_state: Literal["reset", "keep"] = "reset",
    ) -> None:
        if not 0 < client_fraction <= 1:
            raise ConfigError(f"client_fraction={client_fraction}: must be in (0, 1]")
        if vectorize not in ("auto", "always", "never"):
            raise ConfigError(f"vectorize={vectorize!r}: choose auto, always or never")
        if max_chunk_clients is not None and max_chunk_clients < 1:
            raise ConfigError(f"max_chunk_clients={max_chunk_clients}: must be >= 1 or null")
        self.module = module
        self.dm = datamodule
        schedule = _clamped(schedule, datamodule.client_sizes)
        self.schedule = schedule
        self.seed = int(seed)
        self.client_fraction = float(client_fraction)
        self.vectorize = vectorize
        self.batch_invariant = bool(batch_invariant)
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.buffer_names = client_buffer_names(module)
        self.local_names: list[str] = []  # FedBN: kept per client within a call (local_layers.py)
        self.spec = optimizer_spec(module, self.names)
        self.local = LocalTrainer(
            module, datamodule, schedule, self.spec, self.names, self.seed, self.buffer_names
        )
        self.local.compiled = bool(compile)
        self.local.clip = grad_clip(module, gradient_clip_val, gradient_clip_algorithm)
        if optimizer_state not in ("reset", "keep"):
            raise ConfigError(f"optimizer_state={optimizer_state!r}: choose reset or keep")
        self.keep_state = optimizer_state == "keep"
        self.sizes = np.asarray(datamodule.client_sizes, dtype=np.int64)
        self._mode: str | None = {"always": "stacked", "never": "loop"}.get(vectorize)
        self.mode_reason = {"always": "vectorize: always", "never": "vectorize: never"}.get(vectorize, "")
        # ``always`` checks the stacked path against the loop once (path_choice.check_agreement).
        self._unchecked = vectorize == "always"
        if self.keep_state:  # each client's optimizer object lives on only in the loop
            self._mode, self._unchecked = "loop", False
            self.mode_reason = (
                "optimizer_state: keep carries each client's optimizer state on the per-client loop"
            )
        # Called once with a one-line account of the path taken (e.g. the trainer's print).
        self.on_mode: Callable[[str], None] | None = None
        # ``vectorize: auto``'s progress lines while it times the paths (e.g. the trainer's print).
        self.on_probe: Callable[[str], None] | None = None
        # Seconds spent choosing the path (a progress display leaves them out of its rate).
        self.probe_seconds = 0.0
        self._work: int | None = None
        self._announced = False
        self.chunk = max_chunk_clients or self._chunk_from_budget(memory_budget_mb)
        self.policy: ParticipantPolicy = KeyedSampling(self.client_fraction, self.seed)
        self._cuda = next(module.parameters()).device.type == "cuda"  # asked every round: once
        self.sum_plans: dict = {}  # GroupSums' block plans, by chunk layout (aggregate.py)
        self.lean_frames: dict = {}  # the lean path's buffers and views, by segment shape (lean_rounds.py)
        self.lean_arena: dict = {}  # the memory those buffers share
        self._block: tuple[tuple, int | None] | None = None
        # Run eligible calls on the lean path (lean_rounds.py); False forces the general one (tests).
        self.lean_rounds = True

    # -- parameters ------------------------------------------------------------------------------
    def with_optimizer(self, spec: OptimizerSpec) -> FederatedEngine:
        """A new engine like this one with another client optimizer (e.g. a preconditioned one).

        Both paths of the new engine use ``spec``: the stacked one over the stacked leaves, the
        per-client loop over the worker module's parameters (instead of the model's
        ``configure_optimizers``). This engine is unchanged; the built kernels are shared.
        """
        new = copy.copy(self)
        new.local = copy.copy(self.local)
        new.spec = new.local.spec = spec
        new.local.loop_uses_spec = True
        new.local.lr_at = None  # the new optimizer's own learning rates replace the model's scheduler
        return new

    def with_participants(self, policy: ParticipantPolicy) -> FederatedEngine:
        """A new engine like this one whose rounds take ``policy``'s participants (e.g. FATS)."""
        if not isinstance(policy, ParticipantPolicy):
            raise ConfigError(f"participants policy {policy!r}: must be callable (stage, group, round)")
        new = copy.copy(self)
        new.policy = policy
        return new

    @property
    def samples_everyone(self) -> bool:
        """Every client of a group takes part in every round (costs follow from sizes alone)."""
        return isinstance(self.policy, KeyedSampling) and self.policy.everyone

    def module_params(self) -> dict[str, Tensor]:
        """The module's current trainable parameters and client buffers (detached copies).

        A model's state in the engine, in the algorithms and in the cache is this dict: the
        running statistics of BatchNorm layers travel with the parameters, are averaged with the
        same FedAvg weights, and are replayed exactly by unlearning.
        """
        named = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        return {n: named[n].detach().clone() for n in self.names + self.buffer_names}

    def _chunk_from_budget(self, budget_mb: float) -> int:
        p = next(self.module.parameters())
        n_params = sum(v.numel() for n, v in self.module.named_parameters() if v.requires_grad)
        sample = math.prod(self.dm.input_shape)
        per_client = p.element_size() * (6 * n_params + 64 * self.schedule.batch_size * sample)
        return max(1, int(budget_mb * 2**20 // per_client))

    def client_steps_of(self, clients: Sequence[int]) -> int:
        """Optimizer steps these clients take in one round (the cost unit)."""
        return int(sum(self.schedule.num_steps(int(self.sizes[c])) for c in clients))

    def latency_of(self, clients: Sequence[int]) -> int:
        """Steps of one round when these clients train in parallel: the slowest one's (SPEC section 8)."""
        return max((self.schedule.num_steps(int(self.sizes[c])) for c in clients), default=0)

    def participants(self, stage: int, group: Group, round_: int) -> list[int]:
        """This round's participants of ``group``, from the engine's participant policy."""
        return self.policy(stage, group, round_)

    # -- local training --------------------------------------------------------------------------
    def _run_local(self, state: dict[str, Tensor], rows: Tensor, batch: ClientBatch) -> LocalResult:
        if self._mode is None or self._unchecked:
            self._decide_on({k: v.index_select(0, rows) for k, v in state.items()}, batch)
        if self._mode == "stacked":
            try:
                res = self._run_stacked(state, rows, batch)
                self.announce()
                return res
            except NotVectorizable as err:
                self._mode, self.mode_reason = "loop", f"{err}; {err.fallback}"
        self.announce()
        return self.local.train_loop(state, batch, rows)

    @property
    def mode_line(self) -> str:
        """One line: which local-training path runs and why."""
        if self._mode == "stacked":
            return f"local training: stacked clients, kernel {self.local.program_status} ({self.mode_reason})"
        return f"local training: per-client loop ({self.mode_reason})"

    def announce(self) -> None:
        """Report the local-training path once (``on_mode``)."""
        if not self._announced and self.on_mode is not None:
            self._announced = True
            self.on_mode(self.mode_line)

    def _run_stacked(self, state: dict[str, Tensor], rows: Tensor, batch: ClientBatch) -> LocalResult:
        q = self.invariant_block()
        if q is None:
            return self.local.train_stacked(state, batch, rows)
        return train_in_blocks(self.local, q, state, rows, batch)

    def _stacked_call(self, state: dict[str, Tensor], batch: ClientBatch) -> LocalResult:
        rows = torch.arange(len(batch.clients), device=next(iter(state.values())).device)
        return self._run_stacked(state, rows, batch)

    def invariant_block(self) -> int | None:
        """Clients per fixed-shape stacked call, or None where the stacked kernels need none.

        On the CPU the hand-written and fx kernels compute each client with its own GEMMs and
        convolutions, independent of the other clients (tested; never one row: :mod:`.lone_rows`);
        ``vmap``'s grouped kernels and every CUDA kernel may choose another algorithm for another
        number of clients, so there each call has exactly this many clients (padded with inert
        copies), also when the memory budget's chunk is smaller.
        """
        if not self.batch_invariant and not self.local.compiled:
            return None
        self.local.program()
        key = (self.local.kernel_choice, self.local.conv_mode, self.local.compiled)
        if self._block is None or self._block[0] != key:  # asked every round: decided once
            own_gemms = key[0].kernel.batch_invariant  # chain, fx: each client's own GEMMs
            free = not self._cuda and own_gemms and key[1] == "per_client" and not key[2]
            # constant: a block that followed the chunk size would vary with it
            self._block = (key, None if free else 64 if self._cuda else 8)
        return self._block[1]

    def _probe(self, start: dict[str, Tensor], batch: ClientBatch) -> str:
        """``vectorize: auto``: time both paths on this model (:func:`.path_choice.choose_path`)."""
        t = time.perf_counter()
        try:
            mode, self.mode_reason = choose_path(self.local, start, batch, self.on_probe, self._work)
        finally:
            self.probe_seconds += time.perf_counter() - t
        return mode

    def set_mode(self, mode: str) -> None:
        """Fix the local-training path (``stacked`` or ``loop``), e.g. the one a cached run used."""
        if mode not in ("stacked", "loop"):
            raise ConfigError(f"vectorize mode {mode!r}: choose stacked or loop")
        self._mode = mode
        self._unchecked = False  # the run trained on this path: its audit, not a probe, checks it
        self.mode_reason = "the path this run was trained with"

    @property
    def mode(self) -> str | None:
        """``stacked`` or ``loop`` once decided."""
        return self._mode

    # -- FedAvg over groups ----------------------------------------------------------------------
    def decide(self, init: dict[str, Tensor], groups: Sequence[Group], stage: int) -> None:
        """``vectorize: auto``: decide on what the general path's first round would time (``always``: check it)."""
        if self._mode is None or self._unchecked:
            steps = self.local.schedule.plan_steps(self.sizes)
            self._work = int(
                sum(g.rounds * int(steps[list(g.clients)].sum()) for g in groups) * self.client_fraction
            )
            sample = first_round_sample(init, groups, stage, self.participants, self.sizes, self.chunk)
            if sample is not None:
                self._decide_on(*sample)

    def _decide_on(self, start: dict[str, Tensor], batch: ClientBatch) -> None:
        """``auto``: probe the two paths on these clients; ``always``: check that they agree.

        Both also train a few clients alone and among others (neighbours.py) where the engine
        promises batch invariance: on the CPU, with ``batch_invariant``.
        """
        invariant = self.batch_invariant and not self._cuda
        self.local.neighbour_run = self._stacked_call if invariant else None
        with one_sample_batchnorm(type(self.module).__name__, f"stage {batch.stage}, round {batch.round}"):
            if self._mode is None:
                self._mode = self._probe(start, batch)
            elif self._unchecked:
                check_agreement(self.local, start, batch)
        self._unchecked = False

    def train_stages(
        self,
        jobs: Sequence[tuple[int, Sequence[Group]]],
        init_of: Callable[[int, list[TrainResult]], dict[str, Tensor]],
    ) -> list[TrainResult]:
        """Unwatched :meth:`train_groups` calls of ``(stage, groups)`` jobs, job j from ``init_of(j, results)``.

        An unlearning request's replay is such a sequence; see :func:`.stages.train_stages`.
        """
        return train_stages(self, jobs, init_of)

    def train_groups_split(
        self,
        ranks: Ranks,
        init: dict[str, Tensor],
        groups: Sequence[Group],
        stage: int = 0,
        on_round_end: Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None] | None = None,
        keep_client_params: bool = False,
        on_merged_round: Callable[[RoundInfo, dict[str, Tensor], Sequence[Group]], None] | None = None,
    ) -> TrainResult:
        """:meth:`train_groups` with the groups split across processes; every rank gets every group's result.

        Rank r trains groups r, r+W, ... (:meth:`Ranks.share`); the models, client-steps and rounds
        run are gathered in group order. Groups are independent (keyed randomness), so the gathered
        models equal a single-process run's. ``on_round_end`` sees this rank's rounds with global
        group indices and may stop its groups; ``on_merged_round`` hears, after the stage and on
        every rank alike, each round merged over all ranks (:class:`RoundRecorder`), so per-round
        metrics describe the whole stage, not one rank's part.
        """
        mine = ranks.share(len(groups))
        idx = torch.as_tensor(mine, dtype=torch.long, device=next(iter(init.values())).device)
        sub_init = {k: v.index_select(0, idx) for k, v in init.items()}
        rounds = RoundRecorder(groups, mine, self.sizes.tolist(), init) if on_merged_round else None

        def hook(info: RoundInfo, state: dict[str, Tensor]) -> Sequence[bool] | None:
            if rounds is not None:
                rounds.record(info, state)
            if on_round_end is None:
                return None
            local = RoundInfo(**{**vars(info), "active": [mine[a] for a in info.active]})
            flags = on_round_end(local, state)
            return None if flags is None else [bool(flags[g]) for g in mine]

        res = self.train_groups(sub_init, [groups[i] for i in mine], stage, hook, keep_client_params)
        params = {k: ranks.gather_rows(v, len(groups)) for k, v in res.params.items()}
        counters = torch.zeros(len(mine), 2, dtype=torch.long)
        counters[:, 0] = torch.as_tensor(res.group_client_steps, dtype=torch.long)
        counters[:, 1] = torch.as_tensor(res.rounds_run, dtype=torch.long)
        both = ranks.gather_rows(counters.to(idx.device), len(groups)).cpu()
        steps, rounds_run = [int(v) for v in both[:, 0]], [int(v) for v in both[:, 1]]
        if rounds is not None:
            for info, avg, everyone in rounds.merged(ranks.all_gather):
                on_merged_round(info, avg, everyone)
        return TrainResult(params, sum(steps), steps, rounds_run, res.seconds, res.history)

    def train_groups(
        self,
        init: dict[str, Tensor],
        groups: Sequence[Group],
        stage: int = 0,
        on_round_end: Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None] | None = None,
        keep_client_params: bool = False,
    ) -> TrainResult:
        """FedAvg of every group from its row of ``init`` for its own number of rounds.

        Args:
            init: Initial models stacked [G, ...], one row per group.
            groups: The groups, in the order of ``init``'s rows.
            stage: Stage number (part of the randomness key).
            on_round_end: Called after each round with the round's record and the current group
                models; may return one bool per group, True to stop that group early (the
                rounds actually run are reported in ``rounds_run``).
            keep_client_params: Put the participants' final and start parameters in the record.
        """
        if self.lean_rounds and not keep_client_params:
            self.decide(init, groups, stage)
            if lean_eligible(self, groups):  # the same results, leaner
                return drive(LeanRounds(self, init, groups, stage), groups, on_round_end)
        return drive(_GeneralRounds(self, init, groups, stage, keep_client_params), groups, on_round_end)


class _GeneralRounds:
    """The driver's general round runner: any participants, chunks, local step or kept client parameters.

    One round per :meth:`run`: a :class:`RoundPlan` per participants (kept for all rounds of the
    same ones), the chunks trained stacked, each group's participants averaged by :class:`GroupSums`.
    """

    def __init__(
        self,
        engine: FederatedEngine,
        init: dict[str, Tensor],
        groups: Sequence[Group],
        stage: int,
        keep_client_params: bool,
    ) -> None:
        self.engine, self.groups, self.stage, self.keep_client_params = (
            engine,
            groups,
            stage,
            keep_client_params,
        )
        engine.local.client_states = {} if engine.keep_state else None  # every call starts fresh: replayable
        self.state = state = {k: v.clone() for k, v in init.items()}
        self.local = LocalLayers(engine.local_names)
        self.dev = next(iter(state.values())).device
        self.dtype = state[engine.names[0]].dtype
        engine.local.plans.clear()
        self.plans: dict[tuple, RoundPlan] = {}  # by participants: one plan for all rounds of the same ones
        self.layout = SumLayout.of(state)
        self.active: list[int] = []

    def begin(self, active: list[int], start: int) -> None:
        """Note the segment's groups (participants are drawn, and planned, per round)."""
        self.active = active

    def run(
        self,
        rounds: range,
        history: list[RoundInfo],
        hook: Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None] | None,
        stopped: list[bool],
    ) -> tuple[int, dict[int, int]]:
        """Train round ``rounds[0]``, record it and call ``hook``; one round and each active group's client-steps."""
        eng, groups, stage, state, active = self.engine, self.groups, self.stage, self.state, self.active
        keep_client_params, local = self.keep_client_params, self.local
        G = len(groups)
        r = rounds[0]
        tr = time.perf_counter()
        parts = [eng.participants(stage, groups[i], r) for i in active]
        key = (tuple(active), *map(tuple, parts))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = RoundPlan.build(
                active, parts, G, eng.sizes, eng.chunk, self.dtype, self.dev
            )
            if eng.samples_everyone:  # the same clients until a group ends: plan those rounds together
                last = min(groups[i].rounds for i in active)
                for ch in plan.chunks:
                    eng.local.plans.expect(ch.clients, [groups[i].key for i in ch.owners], stage, last)
        sums = GroupSums(state, plan.counts, eng.sum_plans, self.layout)
        loss_sum = torch.zeros(G, dtype=torch.float64)
        step_count = np.zeros(G, dtype=np.int64)
        logged: dict[str, float] = {}
        kept: list[LocalResult] = []
        for ch in plan.chunks:
            cl, ow = ch.clients, ch.owners
            with one_sample_batchnorm(type(eng.module).__name__, f"stage {stage}, round {r}"):
                start, rows = local.start(state, ch.owners_t, cl)
                res = eng._run_local(start, rows, ClientBatch(cl, [groups[i].key for i in ow], stage, r))
            losses = res.loss_sum.detach().cpu().double()  # one host copy: the check and the sums
            check_finite(losses.numpy(), cl, ow, groups, stage, r)
            local.keep(res.params, cl)
            sums.add(res.params, ch.samples, ow, ch.meta)
            loss_sum.index_add_(0, ch.owners_cpu, losses)
            step_count += np.bincount(ow, weights=res.steps, minlength=G).astype(np.int64)  # exact
            add_logged(logged, res, ch)
            if keep_client_params:
                kept.append(res)
        before = {k: v.clone() for k, v in state.items()} if keep_client_params else None
        sums.write_averages(state, plan.active_t, plan.active_weight)
        steps_this = int(step_count.sum())
        info = RoundInfo(
            stage=stage,
            round=r,
            active=active,
            participants=parts,
            mean_loss=(loss_sum.numpy()[active] / np.maximum(step_count[active], 1)).tolist(),
            client_steps=steps_this,
            seconds=time.perf_counter() - tr,
            start_params=before,
            client_params=(
                {k: torch.cat([x.params[k] for x in kept]) for k in eng.names + eng.buffer_names}
                if keep_client_params
                else None
            ),
            client_ids=plan.clients,
            metrics={k: v / plan.metric_norm for k, v in logged.items()},
        )
        history.append(info)
        if hook is not None:
            stop = hook(info, state)
            if stop is not None:
                for i, s in enumerate(stop):
                    stopped[i] = stopped[i] or bool(s)
        return 1, {i: int(step_count[i]) for i in active}

    def params(self) -> dict[str, Tensor]:
        """The state itself (updated in place, round after round)."""
        return self.state


def _clamped(schedule: LocalSchedule, client_sizes: Any) -> LocalSchedule:
    """The schedule with its batch size cut to the largest client, with a note when that changes it.

    A batch never holds more than a client's samples, so the cut trains the same bits (every
    batch is the same samples), but the stacked buffers are sized by the batch size: a typo such as
    ``batch_size: 1000000000`` would otherwise try to allocate gigabytes.
    """
    largest = max((int(n) for n in client_sizes), default=0)
    if largest < 1 or schedule.batch_size <= largest:
        return schedule
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) in ("", "0"):
        sys.stderr.write(
            f"note: algorithm.batch_size={schedule.batch_size} is larger than the largest client ({largest} "
            f"samples); batches are sized {largest}, which trains the same bits\n"
        )
    return dataclasses.replace(schedule, batch_size=largest)
