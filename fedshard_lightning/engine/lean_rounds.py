"""Rounds of the same participants with every per-round decision made once (the engine's lean path).

Unlearning retrains one shard per stage: rounds of one, three or seven clients whose local work
is a few dozen small kernels. There the engine's per-round bookkeeping (plans, layouts,
allocations, a host check and a dozen dict operations) cost about as much as the training itself,
so the wall-clock gain of retraining few clients fell far short of its gain in client-steps.

:class:`LeanRounds` is the engine driver's (:func:`.driver.drive`) second round runner, for a call
of :meth:`.FederatedEngine.train_groups` that keeps no client parameters, when every round of a
segment has the same participants (full participation) in one chunk and the local step is the
hand-written chain with plain SGD fused into its backward. The driver walks the segments (rounds
with the same active groups); per segment the runner makes once what the general runner remakes
every round: the batch plans of all its rounds (one vectorized call), the step layout, the index
tensors, the parameter and sum buffers (kept by shape, :mod:`.lean_frames`) and the block plan of
the sums. A round is then the chain
steps, one weighted sum and one row copy per dtype. Unwatched rounds (no ``on_round_end``) check
their losses once per window; watched ones get their record and hook after every round. The
operators and their operands are those of the general path, so the results are the same bits
(``tests/engine/test_lean_rounds.py`` compares every result of both paths).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine.aggregate import _ONE_PASS, SumLayout, cached_block_plan
from fedshard_lightning.engine.driver import RoundHook, drive
from fedshard_lightning.engine.groups import Group, RoundInfo, TrainResult, check_finite
from fedshard_lightning.engine.lean_frames import Frame, LeanEngine, frame_for
from fedshard_lightning.engine.optim import fused_sgd_lr
from fedshard_lightning.engine.round_plan import RoundPlan

__all__ = ["LeanRounds", "lean_eligible", "run_lean"]


def lean_eligible(engine: LeanEngine, groups: Sequence[Group]) -> bool:
    """Whether :func:`run_lean` can run these groups (the caller keeps no client parameters)."""
    local = engine.local
    if engine.mode != "stacked" or engine.local_names or engine.buffer_names or not engine.samples_everyone:
        return False
    local.program()  # the kernel choice, made once
    if local.compiled or local.lr_at is not None or local.chain is None or local.clip is not None:
        return False
    if engine.invariant_block() is not None or fused_sgd_lr(local.spec) is None:
        return False
    return sum(len(g.clients) for g in groups) <= engine.chunk  # every round in one chunk


def run_lean(
    engine: LeanEngine,
    init: dict[str, Tensor],
    groups: Sequence[Group],
    stage: int,
    on_round_end: RoundHook | None = None,
    deferred: list[Callable[[], object]] | None = None,
) -> TrainResult:
    """:meth:`.FederatedEngine.train_groups` of ``groups`` (see :func:`lean_eligible`): the driver with :class:`LeanRounds`."""
    return drive(LeanRounds(engine, init, groups, stage, deferred), groups, on_round_end)


class LeanRounds:
    """The driver's lean round runner: a :class:`_Segment` per segment, windows of rounds planned together.

    ``on_round_end`` is called after every round as the general runner calls it (with the state as
    contiguous tensors). Without one, the records of the rounds (and their check for non-finite
    losses) are appended per window, or, given ``deferred``, to be made after the caller's later
    calls (:func:`.stages.finish`): host work between training calls cools the caches the next
    call trains with.
    """

    def __init__(
        self,
        engine: LeanEngine,
        init: dict[str, Tensor],
        groups: Sequence[Group],
        stage: int,
        deferred: list[Callable[[], object]] | None = None,
    ) -> None:
        self.engine, self.groups, self.stage, self.deferred = engine, groups, stage, deferred
        self.layout = SumLayout.of(init)
        self.flats, self.state = _flat_state(init, self.layout)
        self.segment: _Segment | None = None

    def begin(self, active: list[int], start: int) -> None:
        """Make the segment's plan, steps and window (its frame comes with its first window)."""
        with torch.no_grad():
            self.segment = _Segment(
                self.engine, self.state, self.layout, self.groups, active, self.stage, start
            )

    def run(
        self, rounds: range, history: list[RoundInfo], hook: RoundHook | None, stopped: list[bool]
    ) -> tuple[int, dict[int, int]]:
        """Train one window of ``rounds``; the rounds run and each active group's client-steps."""
        segment = self.segment
        assert segment is not None
        window = range(rounds.start, min(rounds.stop, rounds.start + segment.window))
        with torch.no_grad():
            ran = segment.run(self.flats, self.state, window, history, hook, stopped, self.deferred)
        return ran, {i: ran * s for i, s in segment.steps_of.items()}

    def params(self) -> dict[str, Tensor]:
        """The state as contiguous tensors (the flat matrices' views are not)."""
        self.engine.announce()
        return {k: v.contiguous() for k, v in self.state.items()}


def _flat_state(init: dict[str, Tensor], layout: SumLayout) -> tuple[list[Tensor], dict[str, Tensor]]:
    """A copy of ``init`` held as one [G, D] matrix per dtype (in the sums' layout) and views by name."""
    g = len(next(iter(init.values())))
    flats, state = [], {}
    for names in layout.kinds:
        first = init[names[0]]
        flat = first.new_empty((g, sum(layout.numel[k] for k in names)))
        off = 0
        for k in names:
            n = layout.numel[k]
            state[k] = flat[:, off : off + n].view(g, *layout.shapes[k])
            state[k].copy_(init[k])
            off += n
        flats.append(flat)
    return flats, state


class _Segment:
    """Rounds ``start..`` with the same active groups: everything but the training made once.

    The round's batches go to fixed buffers whose per-step views, like those of the sums' tree
    (:class:`.lean_sums.InPlaceSums`), are made with the buffers: in a :class:`_Frame`, which
    depends on the segment's shapes alone and is kept by the engine for later calls.
    """

    def __init__(
        self,
        engine: LeanEngine,
        state: dict[str, Tensor],
        layout: SumLayout,
        groups: Sequence[Group],
        active: list[int],
        stage: int,
        start: int,
    ) -> None:
        local = engine.local
        self.engine, self.layout, self.groups, self.stage = engine, layout, groups, stage
        parts = [engine.participants(stage, groups[i], start) for i in active]
        first = next(iter(state.values()))
        dev, dtype = first.device, first.dtype
        self.plan = RoundPlan.build(active, parts, len(groups), engine.sizes, engine.chunk, dtype, dev)
        (self.chunk,) = self.plan.chunks
        self.clients, self.owners = self.chunk.clients, self.chunk.owners
        self.keys = [groups[i].key for i in self.chunk.owners]
        m = self.m = len(self.clients)
        self.lr = fused_sgd_lr(local.spec)
        steps = local.schedule.plan_steps(engine.sizes[self.clients])
        self.steps_of = {i: 0 for i in active}
        for o, s in zip(self.owners, steps.tolist()):
            self.steps_of[o] += int(s)
        self.group_steps = np.zeros(len(groups), dtype=np.int64)  # per group, for the records
        for i, s in self.steps_of.items():
            self.group_steps[i] = s
        slots = int(steps.max(initial=0)) * m * local.schedule.batch_size
        self.window = max(1, local.plans.budget // max(slots, 1))  # rounds planned together
        self.block = cached_block_plan(engine.sum_plans, self.chunk.meta, dev)
        self.all_active = len(active) == len(groups)
        self.dtypes = tuple(state[names[0]].dtype for names in layout.kinds)
        self.recording = _Recording(self.plan, self.clients, self.owners, groups, stage, self.group_steps)
        self.frame: Frame | None = None  # taken by the first window (it follows from the batch sizes)
        self.wcol: list[Tensor] = []  # per dtype: the participants' sample counts, a column
        self.avg_w: list[Tensor] = []  # per dtype: the active groups' sample totals, a column

    def run(
        self,
        flats: list[Tensor],
        state: dict[str, Tensor],
        rounds: range,
        history: list[RoundInfo],
        hook: RoundHook | None,
        stopped: list[bool],
        deferred: list[Callable[[], object]] | None = None,
    ) -> int:
        """Train ``rounds`` (consecutive, planned together), average each into ``state``; rounds run.

        Without ``hook`` the losses are checked and recorded once at the end; with one, after every
        round, and a round whose hook stops a group is the last one run here.
        """
        local, m = self.engine.local, self.m
        planned = local.plans.plan(self.clients, self.keys, self.stage, rounds)
        v = self.frame
        gsz, steps = (planned[0][1], planned[0][2]) if v is None else (v.gsz, v.steps)
        for _, g, n in planned:  # sizes follow from the clients' sample counts: the same every round
            if not (np.array_equal(g, gsz) and np.array_equal(n, steps)):
                raise RuntimeError("batch sizes changed between rounds of the same participants")
        if v is None:
            v = self.frame = frame_for(self, gsz, steps, flats[0].device)
            self.wcol = [self.chunk.samples.to(x.dtype).unsqueeze(1) for x in v.xbuf]
            self.avg_w = [self.plan.active_weight.to(x).unsqueeze(1) for x in v.xbuf]
        lay = v.lay
        gidx_all = torch.as_tensor(
            np.stack([(p[0] if lay.in_order else p[0][lay.order]).transpose(1, 0, 2) for p in planned]),
            device=flats[0].device,
        )  # [R, S, m, B] in step order
        if v.pad:  # a lone client's inert copy trains on its batches
            gidx_all = gidx_all.repeat(1, 1, 1 + v.pad, 1)
        losses = flats[0].new_zeros((len(rounds), m), dtype=local.dtype)  # step order
        dm, chain, lr = local.dm, local.chain, self.lr
        times = []
        for j in range(len(rounds)):
            tr = time.perf_counter()
            for k, leaf in v.leaves.items():
                torch.index_select(state[k], 0, v.pick, out=leaf)
            if v.batch is not None:  # the round's batches in one gather, into the steps' views
                dm.gather(gidx_all[j], local.dtype, out=v.batch)
            row = losses[j]
            for s, (live, rows) in enumerate(zip(lay.live, v.rows_at)):
                if s == v.hold_at:
                    v.keep_held()
                if v.batch is not None:
                    x, y = v.xs[s], v.ys[s]
                else:
                    x, y = dm.gather(gidx_all[j, s, :rows], local.dtype)
                loss, _ = chain.step(v.named[s], x, y, v.ws[s], lr)
                (row if live == m else row[:live]).add_(loss if rows == live else loss[:live])
            if v.held:
                v.put_back_held()
            self._average(flats, v)
            times.append(time.perf_counter() - tr)
            if hook is not None:
                row = losses[j : j + 1] if v.inverse is None else losses[j : j + 1].index_select(1, v.inverse)
                (info,) = _record(self.recording, row, rounds[j : j + 1], times[j:], history)
                stop = hook(info, {k: v_.contiguous() for k, v_ in state.items()})
                if stop is not None:
                    for i, s_ in enumerate(stop):
                        stopped[i] = stopped[i] or bool(s_)
                    if any(stopped[i] for i in self.plan.active):
                        return j + 1
        if hook is None:
            ordered = losses if v.inverse is None else losses.index_select(1, v.inverse)
            if deferred is None:
                _record(self.recording, ordered, rounds, times, history)
            else:
                deferred.append(partial(_record, self.recording, ordered, rounds, times, history))
        return len(rounds)

    def _average(self, flats: list[Tensor], v: Frame) -> None:
        """Sample-weighted FedAvg of the leaves into the state rows of the active groups (GroupSums' bits)."""
        for parts, x, sums, flat, tree, wcol, avg_w in zip(
            v.rows, v.xbuf, v.sums, flats, v.trees, self.wcol, self.avg_w
        ):
            if x.numel() < _ONE_PASS:  # few elements: two or three calls cost less than one per tensor
                if v.inverse is None:
                    torch.cat(parts, 1, out=x)
                else:  # participant order: the sums add rows in it
                    torch.index_select(torch.cat(parts, 1), 0, v.inverse, out=x)
                x.mul_(wcol)
            else:  # weighted rows written straight into the matrix: one pass over memory
                if v.inverse is not None:
                    parts = [t.index_select(0, v.inverse) for t in parts]
                off = 0
                for t in parts:
                    torch.mul(t, wcol, out=x[:, off : off + t.shape[1]])
                    off += t.shape[1]
            sums.zero_()
            tree.reduce(sums)
            if self.all_active:
                torch.div(sums, avg_w, out=flat)
            else:
                flat.index_copy_(0, self.plan.active_t, sums.index_select(0, self.plan.active_t) / avg_w)


@dataclass(frozen=True)
class _Recording:
    """What a segment's round records are made of (kept by a deferred record instead of its buffers)."""

    plan: RoundPlan
    clients: list[int]
    owners: list[int]
    groups: Sequence[Group]
    stage: int
    group_steps: np.ndarray


def _record(
    rec: _Recording, losses: Tensor, rounds: range, times: list[float], history: list[RoundInfo]
) -> list[RoundInfo]:
    """Check the losses and add the rounds' records (as the general path makes them); the new records."""
    plan = rec.plan
    host = losses.detach().cpu().double()
    finite = torch.isfinite(host)
    if not bool(finite.all()):
        j = int((~finite).any(1).nonzero()[0])
        check_finite(host[j].numpy(), rec.clients, rec.owners, rec.groups, rec.stage, rounds[j])
    sums = torch.zeros((len(rounds), len(rec.groups)), dtype=torch.float64)
    sums.index_add_(1, plan.chunks[0].owners_cpu, host)
    steps = rec.group_steps
    total = int(steps.sum())
    means = (sums.numpy()[:, plan.active] / np.maximum(steps[plan.active], 1)).tolist()
    new = [
        RoundInfo(
            stage=rec.stage,
            round=r,
            active=list(plan.active),
            participants=plan.parts,
            mean_loss=means[j],
            client_steps=total,
            seconds=times[j],
            client_ids=plan.clients,
        )
        for j, r in enumerate(rounds)
    ]
    history.extend(new)
    return new
