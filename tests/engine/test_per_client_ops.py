"""Position-dependent activations on the stacked path: each client's bits are its bits alone.

On the CPU, float32 ``sigmoid``, ``silu`` and tanh-``gelu`` round a tensor's vector body and its
scalar tail differently; over all clients' merged activations a client's tail elements depended
on its row, so stacked clients got other bits among others than alone (digits audit: 1.5e-7),
and ``vectorize: always`` refused such models. The reference here is written from scratch: each
client alone, its own ``[1, ...]`` GEMMs, the activation on its own ``[batch, features]``, mean
cross entropy and ``p - lr * grad`` (``add(alpha)``), on the samples the engine's plan gives it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tiny import tiny_trainer
from torch import nn

from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, LocalSchedule, stack_params
from fedshard_lightning.engine.kernels import FX
from fedshard_lightning.engine.kernels.per_client_ops import ClientChunks, PerClient
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.models import MLP

ACTIVATIONS = {
    "sigmoid": (nn.Sigmoid, torch.sigmoid),
    "silu": (nn.SiLU, F.silu),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), lambda h: F.gelu(h, approximate="tanh")),
    "selu": (nn.SELU, F.selu),
    "celu": (nn.CELU, F.celu),
}


def _mlp(act: str, hidden: tuple[int, ...]) -> MLP:
    make = ACTIVATIONS[act][0]

    class ActMLP(MLP):
        def configure_model(self) -> None:
            super().configure_model()
            self.net = nn.Sequential(*[make() if isinstance(m, nn.ReLU) else m for m in self.net])

    torch.manual_seed(0)
    return ActMLP(hidden=hidden, lr=0.1)


def _alone(start, c, gidx, gsz, steps, dm, act, lr=0.1):
    """Client ``c`` trained alone from scratch (layers net.1, net.3, ... then the logits)."""
    fn = ACTIVATIONS[act][1]
    p = {n: v[c].clone() for n, v in start.items()}
    layers = sorted({n.rsplit(".", 1)[0] for n in p}, key=lambda n: int(n.split(".")[-1]))
    for s in range(int(steps[c])):
        x, y = dm.gather(torch.as_tensor(gidx[c, s, : gsz[c, s]])[None], torch.float32)
        h, y = x[0].reshape(x.shape[1], -1), y[0]
        q = {n: v.clone().requires_grad_() for n, v in p.items()}
        for i, name in enumerate(layers):
            w, b = q[name + ".weight"], q[name + ".bias"]
            h = torch.baddbmm(b[None, None], h[None], w.t()[None])[0]
            h = fn(h) if i < len(layers) - 1 else h
        grads = torch.autograd.grad(F.cross_entropy(h, y, reduction="none").mean(), list(q.values()))
        p = {n: p[n].add(g, alpha=-lr) for n, g in zip(q, grads)}
    return p


@pytest.mark.exactness
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("hidden", "batch"), [(15, 5), (13, 7)])  # 75 and 91 elements per client
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_stacked_client_equals_the_client_trained_alone_from_scratch(act, hidden, batch, threads):
    k = 8
    sizes = dict(num_clients=k, min_client_size=3 * batch, num_samples=k * 4 * batch, num_test=20)
    dm = SyntheticDataModule(partition="dirichlet", rho=0.5, shape=(13,), num_classes_=5, **sizes)
    dm.setup()
    m = _mlp(act, (hidden, hidden))
    m.bind_data(dm.input_shape, dm.num_classes)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=batch, local_steps=3), seed=1, vectorize="always")
    torch.manual_seed(1)
    start = {n: v + 0.05 * torch.randn_like(v) for n, v in stack_params([eng.module_params()] * k).items()}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for clients in (list(range(3)), list(range(k))):
            batch_ = ClientBatch(clients, [0] * len(clients), 0, 0)
            got = eng._stacked_call({n: v[: len(clients)] for n, v in start.items()}, batch_)
            gidx, gsz, steps = eng.local.schedules(batch_)
            assert (gsz[:, :3] == batch).all()  # full batches: no padding in the engine's step
            for c in clients:
                want = _alone(start, c, gidx, gsz, steps, dm, act)
                for n in want:
                    assert torch.equal(got.params[n][c], want[n]), (c, n, len(clients))
    finally:
        torch.set_num_threads(before)
    assert eng.local.kernel_choice.kernel is FX


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "fn",
    [
        nn.Sigmoid(),
        nn.SiLU(),
        nn.ELU(),
        nn.SELU(),
        nn.CELU(),
        nn.GELU(),
        nn.GELU(approximate="tanh"),
        nn.Softplus(),
        nn.Mish(),
    ],
    ids=lambda f: repr(f),
)
def test_per_client_forward_and_backward_are_each_clients_own(fn, dtype):
    c, b, f = 7, 5, 15
    torch.manual_seed(0)
    h = 3 * torch.randn(c * b, f, dtype=dtype)
    g = torch.randn(c * b, f, dtype=dtype)
    chunks = ClientChunks()
    op = PerClient(fn, (), {}, chunks)

    def run(hh, gg, clients):
        chunks.clients = clients
        hh = hh.clone().requires_grad_()
        out = op(hh)
        return out.detach(), torch.autograd.grad(out, hh, gg)[0]

    out, grad = run(h, g, c)
    for i in range(c):
        rows = slice(i * b, (i + 1) * b)
        hh = h[rows].clone().requires_grad_()
        want = fn(hh)  # the client alone, plain autograd
        assert torch.equal(out[rows], want.detach())
        assert torch.equal(grad[rows], torch.autograd.grad(want, hh, g[rows])[0])


def _digits() -> DigitsDataModule:
    return DigitsDataModule(num_clients=8, partition="dirichlet", rho=0.5, min_client_size=10, seed=0)


@pytest.mark.exactness
@pytest.mark.parametrize("vectorize", ["always", "auto"])
def test_sigmoid_mlp_stays_stacked_and_audits_bit_exact(tmp_path, capsys, vectorize):
    """Digits (batch 5 x 15 hidden units per client): fit, unlearn client 3, audit; refused before."""
    trainer = tiny_trainer(tmp_path, vectorize=vectorize, run_name="r")
    trainer.fit(_mlp("sigmoid", (15,)), _digits())
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("local training"))
    assert line.startswith("local training: stacked clients, kernel fx"), line
    tiny_trainer(tmp_path, vectorize=vectorize, run_name="r").unlearn(
        _mlp("sigmoid", (15,)), _digits(), tmp_path / "r", [3]
    )
    res = tiny_trainer(tmp_path, vectorize=vectorize, run_name="r").audit(
        _mlp("sigmoid", (15,)), _digits(), tmp_path / "r", tolerance=0.0
    )
    assert res["passed"] and res["max_abs_diff"] == 0.0
