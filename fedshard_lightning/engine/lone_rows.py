"""Stacked CPU calls keep at least two client rows, so a client's bits never depend on training alone.

ATen computes a batched GEMM of one matrix as one GEMM spread over the intra-op threads, and a
batch of several as single-threaded GEMMs side by side (one per client), and the two split the
sums differently: with two threads the chain's fused update ``baddbmm(w, g^T, h, alpha=-lr)`` of
the digits MLP's ``[600 x 10] @ [10 x 64]`` gives a lone client other float32 bits than the same
client among others (every batch of two or more agrees; with one thread every batch agrees). The
free stacked path (hand-written and fx kernels on the CPU, :meth:`.FederatedEngine.invariant_block`)
therefore pads a one-client call with an inert copy of its client (a fixed-shape block of two,
:func:`.fixed_blocks.train_in_blocks`), and keeps a finished client's
row (its results copied out, its later updates discarded, its loss weights 0) rather than shrink
to one row. ``tests/engine/test_lone_rows.py`` checks a client alone against the client among
others.
"""

from __future__ import annotations

import torch

__all__ = ["min_rows"]


def min_rows(device: torch.device) -> int:
    """Fewest client rows a free stacked step may have on ``device`` (2 on a multi-threaded CPU)."""
    return 2 if device.type == "cpu" and torch.get_num_threads() > 1 else 1
