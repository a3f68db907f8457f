"""The lean path's frames: a segment's buffers and views, kept by shape, in memory the frames share.

A frame holds what follows from a segment's shapes alone (the step layout; the participants'
models, the sums' matrices and the round's batches; their views), so a later segment of the same
shapes (the same stage of the next unlearning request) takes it as it is. The frames of an engine
carve their buffers from one block per dtype (:func:`_carve`): a segment uses its frame alone and
writes every buffer before reading it, so frames may overlap, and each stage of a request trains
in memory the stage before it has just used (still in cache) rather than in a cold copy of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine.aggregate import BlockPlan, SumLayout
from fedshard_lightning.engine.groups import Group, RoundInfo, TrainResult
from fedshard_lightning.engine.lean_sums import InPlaceSums
from fedshard_lightning.engine.local import LocalTrainer
from fedshard_lightning.engine.lone_rows import min_rows
from fedshard_lightning.engine.round_plan import Chunk

__all__ = ["Frame", "LeanEngine", "Segment", "frame_for"]


class LeanEngine(Protocol):
    """What the lean rounds read from the engine (:class:`.engine.FederatedEngine`)."""

    local: LocalTrainer
    sizes: np.ndarray
    chunk: int
    sum_plans: dict
    lean_frames: dict
    lean_arena: dict
    lean_rounds: bool
    buffer_names: list[str]
    local_names: list[str]

    @property
    def mode(self) -> str | None:
        """The local-training path (``stacked`` or ``loop``), once decided."""
        ...

    @property
    def samples_everyone(self) -> bool:
        """Whether every client of a group trains in every round."""
        ...

    def participants(self, stage: int, group: Group, round_: int) -> list[int]:
        """The clients of ``group`` that train in round ``round_``."""
        ...

    def invariant_block(self) -> int | None:
        """Clients per fixed-shape stacked call, or None where none is needed."""
        ...

    def announce(self) -> None:
        """Report the local-training path once."""
        ...

    def decide(self, init: dict[str, Tensor], groups: Sequence[Group], stage: int) -> None:
        """Decide the local-training path before the first round."""
        ...

    def train_groups(
        self,
        init: dict[str, Tensor],
        groups: Sequence[Group],
        stage: int = 0,
        on_round_end: Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None] | None = None,
        keep_client_params: bool = False,
    ) -> TrainResult:
        """FedAvg of every group from its row of ``init`` for its own number of rounds."""
        ...


class Segment(Protocol):
    """What a frame reads from a segment of lean rounds (``lean_rounds._Segment``)."""

    engine: LeanEngine
    m: int
    groups: Sequence[Group]
    owners: list[int]
    dtypes: tuple[torch.dtype, ...]
    layout: SumLayout
    chunk: Chunk
    block: BlockPlan


# A round's samples are gathered in one call when they take at most this much memory.
_WHOLE_ROUND_BYTES = 16 << 20
# An engine keeps at most _FRAMES segment frames (buffers and views by shape), sharing blocks of this many
# bytes in all.
_FRAMES_BYTES = 64 << 20
_FRAMES = 16


def frame_for(seg: Segment, gsz: np.ndarray, steps: np.ndarray, dev: torch.device) -> Frame:
    """The frame of a segment's shapes: the engine's kept one, or a new one.

    A new frame laid out in a grown block drops the kept ones (they lie in the old block); one with
    memory of its own (over the budget) serves its segment and is not kept.
    """
    frames, arena = seg.engine.lean_frames, seg.engine.lean_arena
    if sum(b.numel() * b.element_size() for b in arena.values()) > _FRAMES_BYTES:  # the budget was lowered
        frames.clear()
        arena.clear()
    key = (
        seg.m,
        len(seg.groups),
        tuple(seg.owners),
        gsz.shape,
        gsz.tobytes(),
        steps.tobytes(),
        seg.dtypes,
        dev,
        min_rows(dev),
    )
    frame = frames.pop(key, None)  # taken out and put back last: the dict's order is recency
    if frame is None:
        frame = Frame(seg, gsz, steps, dev)
        if frame.placed == "grown":
            frames.clear()
    if frame.placed == "own":
        return frame
    frames[key] = frame
    while len(frames) > _FRAMES:
        del frames[next(iter(frames))]  # the least recently used
    return frame


class Frame:
    """What follows from a segment's shapes alone: the step layout, the buffers and their views.

    Not which clients train (only how many, in which groups, with which batch sizes), so the
    stages of later requests, whose shards have the shapes of earlier ones, take it as it is:
    every buffer is written before it is read in every round. On a multi-threaded CPU no step
    runs over one row (:mod:`.lone_rows`): a one-client segment trains an inert copy of its client
    in a second row (``pad``), and a step keeps finished rows up to two (``rows_at``).
    """

    def __init__(self, seg: Segment, gsz: np.ndarray, steps: np.ndarray, dev: torch.device) -> None:
        local, m, layout = seg.engine.local, seg.m, seg.layout
        self.gsz, self.steps = gsz, steps
        lay = self.lay = local.layouts(gsz, steps, dev, True)
        floor = min_rows(dev)
        self.pad = floor - m if m == 1 else 0
        mp = m + self.pad  # rows trained: the clients and an inert copy of a lone client
        self.rows_at = [min(mp, max(live, floor)) for live in lay.live]
        pick = seg.chunk.owners_t if lay.in_order else seg.chunk.owners_t.index_select(0, lay.order_t)
        self.pick = pick.repeat(mp) if self.pad else pick
        weight = lay.weight_all.repeat(1, mp, 1) if self.pad else lay.weight_all
        self.inverse = None if lay.in_order else torch.argsort(lay.order_t)
        dm = local.dm
        widths = [sum(layout.numel[k] for k in names) for names in layout.kinds]
        specs: dict[object, tuple[tuple[int, ...], torch.dtype]] = {
            k: ((mp, *layout.shapes[k]), dt) for names, dt in zip(layout.kinds, seg.dtypes) for k in names
        }
        for i, (d, dt) in enumerate(zip(widths, seg.dtypes)):
            specs[("x", i)] = ((m, d), dt)  # the participants' models as one [m, D] matrix, for the sums
            specs[("sums", i)] = ((len(seg.groups), d), dt)
        shape = (lay.s_max, mp, local.schedule.batch_size)
        sample = dm.train_x[0].numel() * torch.finfo(local.dtype).bits // 8
        whole = math.prod(shape) * sample <= _WHOLE_ROUND_BYTES  # the round's batches in one gather
        if whole:
            x_like, y_like = dm.gather(torch.zeros((1,), dtype=torch.int64, device=dev), local.dtype)
            specs["batch_x"] = ((*shape, *x_like.shape[1:]), x_like.dtype)
            specs["batch_y"] = (shape, y_like.dtype)
        bufs, self.placed = _carve(seg.engine.lean_arena, specs, dev)
        self.leaves = {k: bufs[k] for names in layout.kinds for k in names}
        self.rows = [[self.leaves[k][:m].view(m, -1) for k in names] for names in layout.kinds]  # [m, n] each
        self.xbuf = [bufs[("x", i)] for i in range(len(widths))]
        self.sums = [bufs[("sums", i)] for i in range(len(widths))]
        self.trees = [InPlaceSums(x, seg.block) for x in self.xbuf]
        self.named = [
            self.leaves if r == mp else {k: t[:r] for k, t in self.leaves.items()} for r in self.rows_at
        ]
        self.ws = [weight[s, :r] for s, r in enumerate(self.rows_at)]
        self.batch: tuple[Tensor, Tensor] | None = (bufs["batch_x"], bufs["batch_y"]) if whole else None
        self.xs = [bufs["batch_x"][s, :r] for s, r in enumerate(self.rows_at)] if whole else []
        self.ys = [bufs["batch_y"][s, :r] for s, r in enumerate(self.rows_at)] if whole else []
        # The step from which a finished client's row is held (trained inert, weight 0): its model,
        # a result of the round, is kept aside then and put back after the last step.
        held = [s for s, (live, r) in enumerate(zip(lay.live, self.rows_at)) if r > live and not self.pad]
        self.hold_at = held[0] if held else -1
        self.held = {k: t[lay.live[self.hold_at]].clone() for k, t in self.leaves.items()} if held else {}

    def keep_held(self) -> None:
        """Keep the held row's model aside (at step ``hold_at``, before it trains inert)."""
        row = self.lay.live[self.hold_at]
        for k, t in self.held.items():
            t.copy_(self.leaves[k][row])

    def put_back_held(self) -> None:
        """Put the held row's model back (after the round's last step)."""
        row = self.lay.live[self.hold_at]
        for k, t in self.held.items():
            self.leaves[k][row].copy_(t)


def _carve(
    arena: dict[tuple[torch.dtype, torch.device], Tensor],
    specs: dict[object, tuple[tuple[int, ...], torch.dtype]],
    dev: torch.device,
) -> tuple[dict[object, Tensor], str]:
    """Buffers of these shapes and dtypes, laid out from the start of the arena's block of each dtype.

    Every frame starts at offset 0, so the frames overlap (see the module docstring). Returns the
    buffers and where they lie: ``"shared"`` (in the blocks as they were), ``"grown"`` (a block
    grew to hold them: frames laid out in the old one no longer share memory with the rest) or
    ``"own"`` (over the whole budget: memory of their own, freed with the frame). So the arena
    never holds more than the budget.
    """
    offsets: dict[object, int] = {}
    need: dict[torch.dtype, int] = {}
    for name, (shape, dt) in specs.items():
        offsets[name] = need.get(dt, 0)
        need[dt] = offsets[name] + -(-max(math.prod(shape), 1) // 16) * 16  # 64-byte aligned starts
    placed = "own" if sum(n * dt.itemsize for dt, n in need.items()) > _FRAMES_BYTES else "shared"
    blocks = {}
    for dt, n in need.items():
        block = None if placed == "own" else arena.get((dt, dev))
        if block is None or block.numel() < n:
            block = torch.empty(n, dtype=dt, device=dev)
            if placed != "own":
                arena[(dt, dev)] = block
                placed = "grown"
        blocks[dt] = block
    bufs = {
        name: blocks[dt][offsets[name] : offsets[name] + math.prod(shape)].view(shape)
        for name, (shape, dt) in specs.items()
    }
    return bufs, placed
