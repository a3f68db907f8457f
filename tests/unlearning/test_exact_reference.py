"""Unlearning equals, bit for bit in float32, a from-scratch FedAvg written here.

The reference shares no code with FedShard's replay, the engine's training loop or its
aggregation: it reads the frozen tree (shards, children, rounds), the partition and the keyed
batch plan, and trains every shard again with its own forward, ``torch.optim.SGD`` and FedAvg
(blocks of 64 clients, each summed by adjacent pairs, blocks in order; SPEC section 3 as
docs/unlearning.md states it), without the leaving clients.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import LocalSchedule
from fedshard_lightning.engine import stages as stages_module
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard

BATCH, SEED, BLOCK = 5, 0, 64


def _fresh(k: int = 8, momentum: float = 0.5):
    dm = SyntheticDataModule(
        num_clients=k,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=20 * k,
        num_test=40,
        shape=(10,),
        num_classes_=4,
    )
    torch.manual_seed(0)
    return MLP(hidden=(16,), lr=0.1, momentum=momentum), dm


def _trainer(root, vectorize):
    return FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=BATCH),
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize=vectorize,
        seed=SEED,
    )


def _fedavg_sum(rows: list[torch.Tensor], weights: list[int]) -> torch.Tensor:
    total = torch.zeros_like(rows[0])
    for lo in range(0, len(rows), BLOCK):
        level = [r * torch.tensor(float(w)) for r, w in zip(rows[lo : lo + BLOCK], weights[lo : lo + BLOCK])]
        level += [torch.zeros_like(rows[0])] * (BLOCK - len(level))
        while len(level) > 1:
            level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
        total = total + level[0]
    return total


def _local(
    model, start: torch.Tensor, dm, client: int, stage: int, shard: int, round_: int, momentum: float
) -> torch.Tensor:
    """One client's round: plain SGD on its keyed batches; returns its flat parameters."""
    torch.nn.utils.vector_to_parameters(start.clone(), model.parameters())  # params become views
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    n = len(dm.client_indices[client])
    pos, sizes, steps = LocalSchedule(batch_size=BATCH).plan(
        np.array([n]), SEED, stage, np.array([shard]), round_, np.array([client])
    )
    own = dm.client_indices[client].numpy()
    for s in range(int(steps[0])):
        idx = torch.as_tensor(own[pos[0, s, : sizes[0, s]]])
        x, y = dm.gather(idx)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _reference(records, theta0: torch.Tensor, dm, gone: set[int], template, momentum: float) -> torch.Tensor:
    model = copy.deepcopy(template)
    prev, prev_w = None, None
    for p, recs in enumerate(records, start=1):
        models, weights = [], []
        for i, rec in enumerate(recs):
            remaining = sorted(c for c in rec.clients if c not in gone)
            if p == 1:
                w, init = float(len(remaining)), theta0.clone()
            else:
                live = [ch for ch in rec.children if prev_w[ch] > 0]
                w = float(sum(prev_w[ch] for ch in live))
                init = torch.zeros_like(theta0)
                for ch in live:
                    init = init + prev[ch] * torch.tensor(prev_w[ch] / w, dtype=torch.float64).float()
            state = init
            for r in range(rec.rounds if remaining else 0):
                rows = [_local(model, state, dm, c, p, i, r, momentum) for c in remaining]
                sizes = [len(dm.client_indices[c]) for c in remaining]
                state = _fedavg_sum(rows, sizes) / torch.tensor(float(sum(sizes)))
            models.append(state)
            weights.append(w if remaining else 0.0)
        prev, prev_w = models, weights
    return prev[0]


@pytest.mark.parametrize(
    ("vectorize", "momentum"),
    [("never", 0.5), ("always", 0.5), ("always", 0.0)],  # plain SGD, stacked: the engine's lean path
)
def test_unlearned_model_equals_independent_from_scratch_fedavg(tmp_path, monkeypatch, vectorize, momentum):
    lean_runs = []
    real = stages_module.run_lean
    monkeypatch.setattr(stages_module, "run_lean", lambda *a, **k: lean_runs.append(a[3]) or real(*a, **k))
    tr = _trainer(tmp_path, vectorize)
    model, dm = _fresh(momentum=momentum)
    tr.fit(model, dm)
    run = tr.run_dir
    names = [n for n, _ in model.named_parameters()]
    theta0 = torch.cat([tr.algorithm.theta0[n].reshape(-1) for n in names])  # the frozen tree's root
    for gone in ([3], [0, 6]):
        ut = _trainer(tmp_path, vectorize)
        lean_runs.clear()
        ut.unlearn(*_fresh(momentum=momentum), str(run), gone)
        assert bool(lean_runs) == (momentum == 0.0)  # a request's stages, through train_stages
        records = ut.algorithm.records
        applied = set(ut.algorithm.unlearned)
        got = load_file(str(run / "model.safetensors"))
        ref_model, ref_dm = _fresh(momentum=momentum)
        ref_dm.setup()
        ref_model.bind_data(ref_dm.input_shape, ref_dm.num_classes)
        want = _reference(records, theta0, ref_dm, applied, ref_model, momentum)
        flat = torch.cat([got[n].reshape(-1) for n in names])
        if vectorize == "never":  # the user's own step, one client at a time: the same float32 bits
            assert torch.equal(flat, want), float((flat - want).abs().max())
        else:  # stacked kernels compute the same math with other float32 roundings
            assert float((flat - want).abs().max()) < 1e-4
