"""How close an unlearning request comes to the same rounds with no framework at all.

``unlearning_speed.py`` compares FedShard's single-client request with FA's retraining in
wall-clock and in client-steps. Their ratios differ because a round has a fixed cost (a few dozen
small kernels of local steps, plus planning and averaging) that FedShard's rounds of one to a few
clients pay as FA's rounds of all clients do. This script separates what is the framework's from
what any eager PyTorch loop pays. For the same fitted methods and the same requests it times

* **request**: ``what_if`` of FedShard and of FA, as ``unlearning_speed.py`` does;
* **rounds**: the sum of their rounds alone (the engine's per-round record), without the
  per-stage work around them (planning the batches, building the stage, averaging children,
  recording the rounds);
* **bare loop**: the same rounds (clients per round and rounds per stage, read from the requests
  themselves) written out with nothing but the operators of a local step and a weighted average:
  forward and backward of the MLP by ``baddbmm``/``bmm`` on stacked clients, fused SGD, and
  ``(flat * w).sum(0) / W``. It plans no keyed batches (its batches are fixed random indices), keeps
  no exactness rule and checks nothing: a floor for eager PyTorch on this machine, sharing no code
  with the engine.

    python benchmarks/unlearning_floor.py                 # K = 64, synthetic data, 1 thread
    python benchmarks/unlearning_floor.py --hidden 512 512
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import unlearning_speed as us
from torch import Tensor

from fedshard_lightning.engine.groups import TrainResult


class Recorder:
    """Wraps an engine's ``train_groups`` and ``train_stages``: clients per round and rounds of each group, and its rounds' time."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.calls: list[tuple[int, int]] = []  # (clients per round, rounds) of each group trained
        self.round_seconds = 0.0
        self._orig = engine.train_groups  # type: ignore[attr-defined]
        self._orig_stages = engine.train_stages  # type: ignore[attr-defined]
        engine.train_groups = self  # type: ignore[attr-defined]
        engine.train_stages = self.stages  # type: ignore[attr-defined]

    def restore(self) -> None:
        """Unwrap the engine."""
        self.engine.train_groups = self._orig  # type: ignore[attr-defined]
        self.engine.train_stages = self._orig_stages  # type: ignore[attr-defined]

    def _add(self, groups: list, res: TrainResult) -> None:
        self.round_seconds += sum(h.seconds for h in res.history)
        self.calls.extend((len(g.clients), g.rounds) for g in groups if g.clients)

    def __call__(self, *args: object, **kwargs: object) -> TrainResult:
        res = self._orig(*args, **kwargs)
        self._add(args[1] if len(args) > 1 else kwargs["groups"], res)  # type: ignore[arg-type]
        return res

    def stages(self, jobs: list, init_of: object) -> list[TrainResult]:
        """``train_stages``, recorded job by job (a request's replay is one such call)."""
        results = self._orig_stages(jobs, init_of)
        for (_, groups), res in zip(jobs, results):
            self._add(groups, res)
        return results


class BareLoop:
    """Stacked FedAvg rounds of an MLP (ReLU hidden layers, cross-entropy), operators only."""

    def __init__(self, widths: list[int], samples: int, batch: int, steps: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.widths, self.batch, self.steps = widths, batch, steps
        self.shapes = [s for a, b in itertools.pairwise(widths) for s in ((b, a), (b,))]
        self.sizes = [torch.Size(s).numel() for s in self.shapes]
        self.x = torch.randn(samples, widths[0], generator=gen)
        self.y = torch.randint(0, widths[-1], (samples,), generator=gen)
        self.model = 0.05 * torch.randn(sum(self.sizes), generator=gen)
        self.minus = torch.full((64 * 1024, 1), -1.0)

    def _params(self, flat: Tensor, c: int) -> list[Tensor]:
        out, off = [], 0
        for s, n in zip(self.shapes, self.sizes):
            out.append(flat[:, off : off + n].view(c, *s))
            off += n
        return out

    def _step(self, ps: list[Tensor], c: int, idx: Tensor, lr: float) -> None:
        b = self.batch
        h = self.x.index_select(0, idx.reshape(-1)).view(c, b, -1)
        y = self.y.index_select(0, idx.reshape(-1)).view(-1, 1)
        acts = [h]
        for i in range(0, len(ps), 2):
            h = torch.baddbmm(ps[i + 1].unsqueeze(1), h, ps[i].transpose(1, 2))
            if i + 2 < len(ps):
                h = h.relu()
            acts.append(h)
        logp = torch.log_softmax(h.view(c * b, -1), 1)
        g = logp.exp_()
        g.scatter_add_(1, y, self.minus[: c * b])
        g = g.mul_(1.0 / b).view(c, b, -1)
        for i in range(len(ps) - 2, -1, -2):
            w, bias, h_in = ps[i], ps[i + 1], acts[i // 2]
            g_in = torch.bmm(g, w) if i > 0 else None
            torch.baddbmm(w, g.transpose(1, 2), h_in, alpha=-lr, out=w)
            bias.add_(g.sum(1), alpha=-lr)
            if g_in is not None:
                g = torch.ops.aten.threshold_backward(g_in, h_in, 0)

    def run(self, calls: list[tuple[int, int]], lr: float = 0.1) -> None:
        """FedAvg rounds: ``rounds`` rounds of ``c`` clients for each (c, rounds), one after the other."""
        model = self.model
        n = len(self.x)
        for c, rounds in calls:
            idx = [torch.randint(0, n, (c, self.batch)) for _ in range(self.steps)]
            w = torch.full((c, 1), float(self.batch * self.steps))
            total = w.sum()
            for _ in range(rounds):
                flat = model.expand(c, -1).clone()
                ps = self._params(flat, c)
                for s in range(self.steps):
                    self._step(ps, c, idx[s], lr)
                model = (flat * w).sum(0) / total


def median_of(fn, repeats: int) -> float:
    """Median wall-clock seconds of ``fn()``."""
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--samples-per-client", type=int, default=20)
    ap.add_argument("--hidden", type=int, nargs="+", default=[64, 64])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats of each request")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ns = argparse.Namespace(
        dataset="synthetic", samples_per_client=args.samples_per_client, hidden=args.hidden
    )
    k = args.clients
    fs = us.fit("FedShard", us.FedShard(merge_rate=2, rounds="a2", t0=2, t1=8, **us.LOCAL), k, ns)
    per_round = fs.alg.engine.client_steps_of(range(k))
    fa = us.fit("FA", us.FedAvg(rounds=max(1, round(fs.fit_steps / per_round)), **us.LOCAL), k, ns)
    steps = per_round // k
    widths = [64, *args.hidden, 10]
    bare = BareLoop(widths, args.samples_per_client * k, us.LOCAL["batch_size"], steps)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); K={k}, MLP {widths}, {steps} steps a round"
    )
    rows = []
    requests = [(2 * i + 1) * k // (2 * args.requests) for i in range(args.requests)]
    for c in requests:
        out = {}
        for name, m in (("FedShard", fs), ("FA", fa)):
            fitted = m.alg.state_dict()
            rec = Recorder(m.alg.engine)
            m.alg.what_if(fitted, [c])  # warm-up, and the request's rounds
            calls = list(rec.calls)
            rec.round_seconds = 0.0
            request = median_of(lambda: m.alg.what_if(fitted, [c]), args.repeats)  # noqa: B023
            rounds = rec.round_seconds / args.repeats
            rec.restore()
            floor = median_of(lambda: bare.run(calls), args.repeats)  # noqa: B023
            out[name] = (request, rounds, floor, calls)
        rows.append((c, out))
    print("| client | method | stages (clients x rounds) | request ms | rounds ms | bare loop ms |")
    print("|---|---|---|---|---|---|")
    for c, out in rows:
        for name, (request, rounds, floor, calls) in out.items():
            shape = " ".join(f"{n}x{r}" for n, r in calls)
            print(
                f"| {c} | {name} | {shape} | {request * 1e3:.1f} | {rounds * 1e3:.1f} | {floor * 1e3:.1f} |"
            )
    print()
    print("| client | FA / FedShard: request | rounds | bare loop | client-rounds |")
    print("|---|---|---|---|---|")
    for c, out in rows:
        (rf, uf, bf, cf), (ra, ua, ba, ca) = out["FedShard"], out["FA"]
        work = sum(n * r for n, r in ca) / sum(n * r for n, r in cf)
        print(f"| {c} | {ra / rf:.2f}x | {ua / uf:.2f}x | {ba / bf:.2f}x | {work:.2f}x |")


if __name__ == "__main__":
    main()
