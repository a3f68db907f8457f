"""Peers on the identical workload: FedAvg with fedshard_lightning, a plain PyTorch loop, Flower and pfl.

Every framework trains FedAvg on the same data and client partition (our datamodule's), from the
same initial weights, for the same rounds, local epochs, batch size and SGD learning rate (no
momentum), with every client visiting its samples in the same batches (the driver writes our
engine's keyed batch schedule into the workload file), so the final models agree up to the order
of float sums; the table shows the largest parameter difference to ours. Each run is a fresh
subprocess; the timed span is training only (after imports and framework start-up, which are
reported apart), and every framework gets the same number of torch threads in total.

* ``ours``: ``FederatedTrainer(algorithm=FedAvg(...))`` with its default callbacks and logging
  (progress bar, CSV metrics, per-round test evaluation, FLCache checkpoint) and ``vectorize:
  auto``, as the CLI runs it; training time is the trainer's own ``seconds``. Worker output goes
  to a log file, so the progress bar (which draws only on a terminal) stays silent.
* ``ours-quiet``: the same without progress bar and per-round evaluation (evaluation at the end).
* ``loop``: a hand-written per-client PyTorch loop (one module, parameters copied in, no deepcopy).
* ``flower``: Flower's Ray simulation engine (``flwr.simulation.start_simulation``), one row per
  actor setting; Ray start-up, actor start-up and Ray shutdown are timed apart; federated
  evaluation is off.
* ``pfl``: pfl-research's ``SimulatedBackend`` with its PyTorch model and ``FederatedAveraging``,
  with its defaults otherwise (it evaluates every user before and after local training in central
  iteration 0 and prints metrics every iteration).

The table's accuracy is every framework's final model evaluated by the same code on the same test
set. Peers come from the ``bench`` extra, best in their own virtual environment (editable, so that
it imports this checkout)::

    python -m venv --system-site-packages /tmp/venvpeers && /tmp/venvpeers/bin/pip install -e '.[bench]'
    python benchmarks/peers.py --workload all --repeats 3 --peer-python /tmp/venvpeers/bin/python
    python benchmarks/peers.py --workload mlp --clients 256 --peer-python /tmp/venvpeers/bin/python
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

FRAMEWORKS = ("ours", "ours-quiet", "loop", "flower", "pfl")
DEFAULT_ROUNDS = {"mlp": 20, "cnn": 2}
NOT_INSTALLED = "not installed (pip install .[bench])"


# -- the workload ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One workload: model, data, and the FedAvg settings shared by every framework."""

    workload: str
    clients: int
    rounds: int
    epochs: int = 1
    batch: int = 10
    lr: float = 0.05
    seed: int = 0


def our_model_and_data(spec: Spec) -> tuple[Any, Any]:
    """Our model and datamodule for ``spec`` (unbound: the trainer binds them)."""
    from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
    from fedshard_lightning.models import MLP, FedAvgCNN

    if spec.workload == "mlp":
        dm = DigitsDataModule(num_clients=spec.clients, partition="iid", seed=spec.seed)
        return MLP(hidden=(64, 64), lr=spec.lr), dm
    dm = SyntheticDataModule(
        num_clients=spec.clients,
        partition="iid",
        num_samples=60 * spec.clients,
        shape=(1, 28, 28),
        as_uint8=True,
        seed=spec.seed,
    )
    return FedAvgCNN(lr=spec.lr), dm


def write_workload(spec: Spec, path: Path) -> dict[str, Any]:
    """Write data, partition, initial weights and every client's batches of every round to ``path``.

    The initial weights are those the trainer starts from (``torch.manual_seed(seed)`` before the
    model is built); the batches are our engine's keyed schedule (stage 0, group 0), so every peer
    visits the same samples in the same order.
    """
    from fedshard_lightning.engine import LocalSchedule

    model, dm = our_model_and_data(spec)
    dm.setup("fit")
    torch.manual_seed(spec.seed)
    model.bind_data(dm.input_shape, dm.num_classes)
    sched = LocalSchedule(batch_size=spec.batch, local_epochs=spec.epochs)
    idx = [ix.numpy() for ix in dm.client_indices]
    sizes, pos = [], []
    for r in range(spec.rounds):
        row_pos, row_sizes = [], []
        for c, own in enumerate(idx):
            p, s = sched.batches(len(own), spec.seed, 0, 0, r, c)
            row_pos += [p[i, : s[i]] for i in range(len(s))]
            row_sizes.append(s)
        pos.append(np.concatenate(row_pos))
        sizes.append(np.concatenate(row_sizes))
    if any(not np.array_equal(s, sizes[0]) for s in sizes):
        raise RuntimeError("batch sizes differ between rounds; the workload file cannot hold them")
    test_x, test_y = dm.test_data()
    meta = {
        **asdict(spec),
        "input_shape": list(dm.input_shape),
        "num_classes": int(dm.num_classes),
        "steps": [math.ceil(len(i) / spec.batch) * spec.epochs for i in idx],
    }
    init = {f"init/{k}": v.detach().numpy() for k, v in model.named_parameters()}
    np.savez(
        path,
        meta=np.array(json.dumps(meta)),
        train_x=dm.transform(dm.train_x).numpy(),
        train_y=dm.train_y.numpy(),
        test_x=test_x.numpy(),
        test_y=test_y.numpy(),
        client_idx=np.concatenate(idx),
        client_sizes=np.array([len(i) for i in idx]),
        batch_sizes=sizes[0],
        batch_pos=np.stack(pos),
        **init,
    )
    return meta


@dataclass
class Workload:
    """The workload file, loaded: per-client tensors and batch plans for the peers."""

    meta: dict[str, Any]
    init: dict[str, Tensor]
    client_x: list[Tensor]
    client_y: list[Tensor]
    test_x: Tensor
    test_y: Tensor
    batch_sizes: list[np.ndarray]
    batch_pos: np.ndarray
    pos_offsets: np.ndarray

    @classmethod
    def load(cls, path: str) -> Workload:
        """Read the file that :func:`write_workload` wrote."""
        z = np.load(path)
        meta = json.loads(str(z["meta"]))
        x, y = torch.from_numpy(z["train_x"]), torch.from_numpy(z["train_y"])
        sizes = z["client_sizes"]
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        idx = torch.from_numpy(z["client_idx"])
        own = [idx[offsets[c] : offsets[c + 1]] for c in range(len(sizes))]
        steps = np.cumsum([0, *meta["steps"]])
        bs = z["batch_sizes"]
        return cls(
            meta=meta,
            init={k[5:]: torch.from_numpy(z[k]) for k in z.files if k.startswith("init/")},
            client_x=[x[i] for i in own],
            client_y=[y[i] for i in own],
            test_x=torch.from_numpy(z["test_x"]),
            test_y=torch.from_numpy(z["test_y"]),
            batch_sizes=[bs[steps[c] : steps[c + 1]] for c in range(len(sizes))],
            batch_pos=z["batch_pos"],
            pos_offsets=np.concatenate([[0], np.cumsum(sizes * meta["epochs"])]),
        )

    @property
    def num_clients(self) -> int:
        """K."""
        return len(self.client_x)

    def order(self, round_: int, client: int) -> np.ndarray:
        """Positions into the client's samples, in the order the client visits them in ``round_``."""
        return self.batch_pos[round_, self.pos_offsets[client] : self.pos_offsets[client + 1]]

    def batches(self, round_: int, client: int) -> list[Tensor]:
        """The client's batches in ``round_``: positions into its own samples."""
        order = torch.from_numpy(self.order(round_, client))
        return list(torch.split(order, self.batch_sizes[client].tolist()))


# -- a plain PyTorch model of the same architecture ------------------------------------------------
class PlainMLP(nn.Module):
    """Our ``MLP``: Flatten, Linear-ReLU per hidden width, Linear (same parameter names)."""

    def __init__(self, input_shape: Sequence[int], hidden: Sequence[int], classes: int) -> None:
        super().__init__()
        widths = [math.prod(input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], classes))

    def forward(self, x: Tensor) -> Tensor:
        """Logits."""
        return self.net(x)


class PlainCNN(nn.Module):
    """Our ``FedAvgCNN``: two 5x5 convolutions with max-pooling, two dense layers."""

    def __init__(self, input_shape: Sequence[int], classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * (h // 4) * (w // 4), 512), nn.ReLU(), nn.Linear(512, classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        """Logits."""
        return self.classifier(self.features(x))


def plain_model(w: Workload) -> nn.Module:
    """The workload's architecture as a plain module holding the initial weights."""
    meta = w.meta
    if meta["workload"] == "mlp":
        model: nn.Module = PlainMLP(meta["input_shape"], (64, 64), meta["num_classes"])
    else:
        model = PlainCNN(meta["input_shape"], meta["num_classes"])
    model.load_state_dict(w.init, strict=True)
    return model


def local_sgd(
    model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, batches: list[Tensor]
) -> None:
    """One client's local training: SGD on the mean cross-entropy of each batch."""
    for pos in batches:
        loss = F.cross_entropy(model(x[pos]), y[pos])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@torch.no_grad()
def accuracy(w: Workload, params: dict[str, Tensor]) -> float:
    """Test accuracy of ``params`` in the workload's architecture."""
    model = plain_model(w)
    model.load_state_dict(params, strict=True)
    model.eval()
    return float((model(w.test_x).argmax(-1) == w.test_y).double().mean())


# -- the workers: one framework, one run, in its own process ---------------------------------------
@dataclass
class RunResult:
    """What one worker measured."""

    framework: str
    setting: str
    train_s: float
    startup_s: float
    shutdown_s: float = 0.0
    import_s: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def run_ours(path: str, quiet: bool) -> tuple[RunResult, dict[str, Tensor]]:
    """``FederatedTrainer.fit`` with ``FedAvg``; training time is the trainer's own ``seconds``."""
    t = time.perf_counter()
    import lightning

    import fedshard_lightning
    from fedshard_lightning import FederatedTrainer
    from fedshard_lightning.callbacks import FederatedCallback
    from fedshard_lightning.unlearning import FedAvg

    import_s = time.perf_counter() - t
    w = Workload.load(path)
    spec = Spec(**{k: w.meta[k] for k in Spec.__dataclass_fields__})
    model, dm = our_model_and_data(spec)
    stamps: dict[str, float] = {}

    class Stamp(FederatedCallback):
        def on_fit_start(self, trainer: Any) -> None:
            stamps["fit_start"] = time.perf_counter()

    kw: dict[str, Any] = {"enable_progress_bar": False, "eval_every_n_rounds": 0} if quiet else {}
    with tempfile.TemporaryDirectory(prefix="peers-ours-") as root:
        trainer = FederatedTrainer(
            algorithm=FedAvg(rounds=spec.rounds, batch_size=spec.batch, local_epochs=spec.epochs),
            default_root_dir=root,
            seed=spec.seed,
            callbacks=[Stamp()],
            enable_fairness=False,  # the peers compute no fairness metrics after training
            **kw,
        )
        t0 = time.perf_counter()
        metrics = trainer.fit(model, dm)
        total = time.perf_counter() - t0
    startup = stamps["fit_start"] - t0
    theta0_diff = max(float((trainer.algorithm.theta0[k] - v).abs().max()) for k, v in w.init.items())
    if theta0_diff != 0.0:
        raise RuntimeError(f"the trainer started from other weights than the workload file ({theta0_diff})")
    result = RunResult(
        framework="ours-quiet" if quiet else "ours",
        setting=f"vectorize auto -> {metrics['vectorize_mode']}"
        + ("; no bar, eval at end" if quiet else "; default callbacks"),
        train_s=metrics["seconds"],
        startup_s=startup,
        shutdown_s=total - startup - metrics["seconds"],
        import_s=import_s,
        versions={"fedshard_lightning": fedshard_lightning.__version__, "lightning": lightning.__version__},
        extra={"own_test_accuracy": metrics["test_accuracy"]},
    )
    return result, {k: v.detach().cpu() for k, v in trainer.algorithm.current_params().items()}


def run_loop(path: str) -> tuple[RunResult, dict[str, Tensor]]:
    """A per-client loop in plain PyTorch: copy the global model in, train, add weighted, average."""
    t0 = time.perf_counter()
    w = Workload.load(path)
    model = plain_model(w)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    glob = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=w.meta["lr"])  # no momentum: stateless, safe to reuse
    n = [len(x) for x in w.client_x]
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in range(w.meta["rounds"]):
        acc = [torch.zeros_like(g) for g in glob]
        for c in range(w.num_clients):
            with torch.no_grad():
                for p, g in zip(params, glob):
                    p.copy_(g)
            local_sgd(model, opt, w.client_x[c], w.client_y[c], w.batches(r, c))
            with torch.no_grad():
                for a, p in zip(acc, params):
                    a.add_(p, alpha=n[c])
        glob = [a / sum(n) for a in acc]
    train = time.perf_counter() - t0
    return RunResult("loop", "per-client loop, plain PyTorch", train, startup), dict(zip(names, glob))


_ACTOR: dict[str, Any] = {}


def _actor_state(path: str, threads: int) -> dict[str, Any]:
    """Per-process state of a Flower actor: the workload and one model, loaded once."""
    if _ACTOR.get("path") != path:
        torch.set_num_threads(threads)
        w = Workload.load(path)
        model = plain_model(w)
        opt = torch.optim.SGD(model.parameters(), lr=w.meta["lr"])
        _ACTOR.update(path=path, w=w, model=model, opt=opt, params=list(model.parameters()))
    return _ACTOR


@functools.cache
def _flower_client_class() -> type:
    """A ``NumPyClient`` that trains with the shared batch plan (defined lazily: flwr is optional)."""
    from flwr.client import NumPyClient

    class PeersClient(NumPyClient):
        def __init__(self, cid: int, path: str, threads: int) -> None:
            self.cid, self.state = cid, _actor_state(path, threads)

        def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
            return [p.detach().numpy().copy() for p in self.state["params"]]

        def fit(
            self, parameters: list[np.ndarray], config: dict[str, Any]
        ) -> tuple[list[np.ndarray], int, dict]:
            if config.get("warmup"):
                return parameters, 1, {}
            st, c = self.state, self.cid
            with torch.no_grad():
                for p, a in zip(st["params"], parameters):
                    p.copy_(torch.from_numpy(a))
            w = st["w"]
            local_sgd(
                st["model"], st["opt"], w.client_x[c], w.client_y[c], w.batches(int(config["round"]), c)
            )
            return self.get_parameters(config), len(w.client_x[c]), {}

    return PeersClient


class FlowerClientFn:
    """Flower's ``client_fn(context)``; a module-level class, so Ray pickles it by reference.

    Args:
        path: Workload file.
        threads: Torch threads of each actor process.
    """

    def __init__(self, path: str, threads: int) -> None:
        self.path, self.threads = path, threads

    def __call__(self, context: Any) -> Any:
        """The client of the context's partition."""
        cid = int(context.node_config["partition-id"])
        return _flower_client_class()(cid, self.path, self.threads).to_client()


def run_flower(path: str, actors: int, threads: int) -> tuple[RunResult, dict[str, Tensor]]:
    """Flower's Ray simulation with ``actors`` actors of ``threads // actors`` torch threads each.

    Start-up is ``ray.init`` plus the actor pool and one untimed warm-up call per client (which
    starts the actor processes and loads the data there); training is ``Server.fit``'s own round
    loop; shutdown is ``ray.shutdown``. Federated evaluation is off (``fraction_evaluate=0``).
    """
    t = time.perf_counter()
    import flwr
    import peers  # this file as a module: Ray pickles FlowerClientFn by reference
    import ray
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import Server, ServerConfig
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.server import fit_clients
    from flwr.server.strategy import FedAvg
    from flwr.simulation import start_simulation

    import_s = time.perf_counter() - t
    w = Workload.load(path)
    k = w.num_clients
    names = list(w.init)
    init = ndarrays_to_parameters([w.init[n].numpy() for n in names])
    times: dict[str, float] = {}
    round_s: list[float] = []

    class TimedServer(Server):
        def fit(self, num_rounds: int, timeout: float | None) -> Any:
            t = time.perf_counter()
            times["pool_s"] = t - times["sim_start"]
            proxies = self.client_manager().sample(num_clients=k, min_num_clients=k)
            fit_clients([(p, FitIns(init, {"warmup": 1})) for p in proxies], self.max_workers, timeout, 0)
            times["warmup_s"] = time.perf_counter() - t
            history, elapsed = super().fit(num_rounds, timeout)
            times["train_s"] = elapsed
            return history, elapsed

        def fit_round(self, server_round: int, timeout: float | None) -> Any:
            t = time.perf_counter()
            res = super().fit_round(server_round, timeout)
            round_s.append(time.perf_counter() - t)
            return res

    strategy = FedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=k,
        min_evaluate_clients=0,
        min_available_clients=k,
        initial_parameters=init,
        on_fit_config_fn=lambda rnd: {"round": rnd - 1},
    )
    server = TimedServer(client_manager=SimpleClientManager(), strategy=strategy)
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    t = time.perf_counter()
    ray.init(num_cpus=threads, include_dashboard=False, ignore_reinit_error=True)
    ray_start = time.perf_counter() - t
    times["sim_start"] = time.perf_counter()
    start_simulation(
        client_fn=peers.FlowerClientFn(path, max(threads // actors, 1)),
        num_clients=k,
        client_resources={"num_cpus": threads / actors, "num_gpus": 0.0},
        server=server,
        config=ServerConfig(num_rounds=w.meta["rounds"]),
        keep_initialised=True,
    )
    t = time.perf_counter()
    ray.shutdown()
    shutdown = time.perf_counter() - t
    final = dict(zip(names, (torch.from_numpy(a.copy()) for a in parameters_to_ndarrays(server.parameters))))
    result = RunResult(
        framework="flower",
        setting=f"{actors} actor{'s' if actors > 1 else ''} x {max(threads // actors, 1)} thread(s)",
        train_s=times["train_s"],
        startup_s=ray_start + times["pool_s"] + times["warmup_s"],
        shutdown_s=shutdown,
        import_s=import_s,
        versions={"flwr": flwr.__version__, "ray": ray.__version__},
        extra={
            "ray_init_s": ray_start,
            "actor_pool_s": times["pool_s"],
            "warmup_s": times["warmup_s"],
            "round_s": round_s,
        },
    )
    return result, final


def run_pfl(path: str) -> tuple[RunResult, dict[str, Tensor]]:
    """pfl's simulated FedAvg: local SGD, updates weighted by data points, central SGD with lr 1.

    Users are sampled in order (``MinimizeReuseUserSampler``, cohort = all clients), and each
    user's dataset is laid out in the round's batch order (pfl's ``Dataset.iter`` does not
    shuffle); with more than one local epoch pfl would repeat that order in every epoch.
    """
    t = time.perf_counter()
    import pfl.version
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import MinimizeReuseUserSampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Weighted
    from pfl.model.pytorch import PyTorchModel

    import_s = time.perf_counter() - t
    t0 = time.perf_counter()
    w = Workload.load(path)
    k, rounds = w.num_clients, w.meta["rounds"]

    class PflNet(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x)

        def loss(self, x: Tensor, y: Tensor, eval: bool = False) -> Tensor:
            return F.cross_entropy(self.net(x), y)  # no train()/eval() switching: no mode-dependent layers

        @torch.no_grad()
        def metrics(self, x: Tensor, y: Tensor, eval: bool = False) -> dict[str, Any]:
            logits = self.net(x)
            return {
                "loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), len(y)),
                "accuracy": Weighted(float((logits.argmax(-1) == y).sum()), len(y)),
            }

    calls = [0] * k

    def make_dataset(uid: int) -> Any:
        order = torch.from_numpy(w.order(calls[uid], uid))
        calls[uid] += 1
        return Dataset(raw_data=[w.client_x[uid][order], w.client_y[uid][order]], user_id=uid)

    def federated() -> Any:
        return FederatedDataset(make_dataset, MinimizeReuseUserSampler(list(range(k))))

    net = PflNet(plain_model(w))
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
    )
    backend = SimulatedBackend(
        training_data=federated(), val_data=federated(), postprocessors=[WeightByDatapoints()]
    )
    algorithm = FederatedAveraging()
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    algorithm.run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds, evaluation_frequency=rounds, train_cohort_size=k, val_cohort_size=0
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=w.meta["epochs"],
            local_learning_rate=w.meta["lr"],
            local_batch_size=w.meta["batch"],
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[],
    )
    train = time.perf_counter() - t0
    if calls != [rounds] * k:
        raise RuntimeError(f"pfl did not train every client once per round: {calls}")
    final = {n[4:]: p.detach().clone() for n, p in net.named_parameters()}
    result = RunResult(
        "pfl",
        "SimulatedBackend, PyTorchModel",
        train,
        startup,
        import_s=import_s,
        versions={"pfl": pfl.version.__version__},
    )
    return result, final


def worker(args: argparse.Namespace) -> None:
    """Run one framework once; write ``<out>.json`` (timings) and ``<out>.npz`` (final model)."""
    torch.set_num_threads(args.threads)
    fw = args.run
    if fw in ("ours", "ours-quiet"):
        result, params = run_ours(args.data, quiet=fw == "ours-quiet")
    elif fw == "loop":
        result, params = run_loop(args.data)
    elif fw == "flower":
        result, params = run_flower(args.data, args.actors, args.threads)
    else:
        result, params = run_pfl(args.data)
    result.versions.update(torch=torch.__version__, python=sys.version.split()[0])
    result.extra["torch_threads"] = torch.get_num_threads()
    np.savez(f"{args.out}.npz", **{k: v.numpy() for k, v in params.items()})
    Path(f"{args.out}.json").write_text(json.dumps(asdict(result)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # Flower leaves a 10 s resource-polling timer thread behind; do not wait for it


# -- the driver -------------------------------------------------------------------------------------
@dataclass
class Row:
    """One table row: a framework setting and its runs."""

    framework: str
    setting: str = ""
    runs: list[RunResult] = field(default_factory=list)
    params: dict[str, Tensor] | None = None
    error: str | None = None

    def median(self, attr: str) -> float:
        """Median of a timing over the runs."""
        return statistics.median(getattr(r, attr) for r in self.runs)


def installed(python: str, modules: Sequence[str]) -> bool:
    """True when ``python`` can import every module."""
    if python == sys.executable:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    code = (
        "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))"
    )
    try:
        return subprocess.run([python, "-c", code, *modules], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        return False


def launch(
    python: str, fw: str, data: Path, out: Path, threads: int, actors: int, timeout: float
) -> tuple[RunResult | None, dict[str, Tensor] | None, str | None]:
    """Run one worker process; return its result and final model, or the reason it failed."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [python, str(Path(__file__).resolve()), "--run", fw, "--data", str(data), "--out", str(out)]
    cmd += ["--threads", str(threads), "--actors", str(actors)]
    log = Path(f"{out}.log")
    try:
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, None, f"timed out after {timeout:.0f} s (log: {log})"
    if proc.returncode != 0 or not Path(f"{out}.json").exists():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        return None, None, f"failed (exit {proc.returncode}): {lines[-1] if lines else ''} (log: {log})"
    result = RunResult(**json.loads(Path(f"{out}.json").read_text()))
    z = np.load(f"{out}.npz")
    return result, {k: torch.from_numpy(z[k]) for k in z.files}, None


def run_workload(spec: Spec, args: argparse.Namespace, tmp: Path) -> list[Row]:
    """All frameworks on one workload, repeats interleaved so that drift hits them alike."""
    data = tmp / f"{spec.workload}-{spec.clients}.npz"
    write_workload(spec, data)
    plan: list[tuple[Row, str, str, int]] = []
    rows: list[Row] = []
    for fw in args.frameworks:
        python = args.peer_python if fw in ("flower", "pfl") else sys.executable
        need = {"flower": ["flwr", "ray"], "pfl": ["pfl"]}.get(fw, [])
        for actors in args.flower_actors if fw == "flower" else [1]:
            row = Row(fw, f"{actors} actor(s)" if fw == "flower" else "")
            rows.append(row)
            if need and not installed(python, need):
                row.error = NOT_INSTALLED
                continue
            plan.append((row, fw, python, actors))
    for rep in range(args.repeats):
        for row, fw, python, actors in plan:
            if row.error:
                continue
            out = tmp / f"{spec.workload}-{spec.clients}-{fw}-{actors}-{rep}"
            result, params, err = launch(python, fw, data, out, args.threads, actors, args.timeout)
            if err:
                row.error = err
                continue
            row.setting, row.params = result.setting, params
            row.runs.append(result)
            print(
                f"  {spec.workload} K={spec.clients} run {rep + 1}/{args.repeats} {fw:<10} {result.setting:<40} "
                f"train {result.train_s:7.3f} s",
                flush=True,
            )
    return rows


def print_table(spec: Spec, rows: list[Row], w: Workload) -> list[dict[str, Any]]:
    """Print the table of one workload and return its rows as dicts."""
    ours = next((r for r in rows if r.framework == "ours" and r.runs), None)
    t_ours = ours.median("train_s") if ours else float("nan")
    n_runs = max((len(r.runs) for r in rows), default=0)
    print(
        f"\n{spec.workload}: K={spec.clients}, {spec.rounds} rounds, all clients each round, E={spec.epochs}, "
        f"B={spec.batch}, SGD lr {spec.lr}; medians of {n_runs} runs"
    )
    head = (
        f"{'framework':<11} {'setting':<44} {'train s':>8} {'start-up s':>10} {'shutdown s':>10} "
        f"{'import s':>8} {'test acc':>8} {'max|dθ| vs ours':>16} {'peer/ours':>9}"
    )
    print(head)
    print("-" * len(head))
    out = []
    for r in rows:
        if r.error or not r.runs:
            print(f"{r.framework:<11} {r.setting:<44} {r.error or 'no runs'}")
            out.append({"framework": r.framework, "setting": r.setting, "error": r.error})
            continue
        acc = accuracy(w, r.params)
        diff = (
            max(float((r.params[k] - ours.params[k]).abs().max()) for k in r.params) if ours else float("nan")
        )
        t = r.median("train_s")
        d = {
            "framework": r.framework,
            "setting": r.setting,
            "train_s": t,
            "train_s_runs": [x.train_s for x in r.runs],
            "startup_s": r.median("startup_s"),
            "shutdown_s": r.median("shutdown_s"),
            "import_s": r.median("import_s"),
            "test_accuracy": acc,
            "max_abs_param_diff_vs_ours": diff,
            "ratio_vs_ours": t / t_ours,
            "versions": r.runs[0].versions,
            "extra": [x.extra for x in r.runs],
        }
        out.append(d)
        diff_s, ratio_s = (f"{diff:.2e}", f"{t / t_ours:.2f}x") if ours else ("n/a", "n/a")
        print(
            f"{r.framework:<11} {r.setting:<44} {t:>8.3f} {d['startup_s']:>10.3f} {d['shutdown_s']:>10.3f} "
            f"{d['import_s']:>8.2f} {acc:>8.4f} {diff_s:>16} {ratio_s:>9}"
        )
    versions = {k: v for r in rows for x in r.runs[:1] for k, v in x.versions.items()}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    return out


def main() -> None:
    """Parse the command line; run the driver (or, with ``--run``, one worker)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["mlp", "cnn", "all"], default="all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None, help="default: 20 (mlp), 2 (cnn)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every framework, in total")
    ap.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    ap.add_argument("--flower-actors", nargs="+", type=int, default=[1, 2])
    ap.add_argument(
        "--peer-python", default=sys.executable, help="python of the environment with flwr and pfl"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--run", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--actors", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        worker(args)
        return
    torch.set_num_threads(args.threads)
    names = ["mlp", "cnn"] if args.workload == "all" else [args.workload]
    print(f"torch {torch.__version__}, {args.threads} threads per framework, peers from {args.peer_python}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        for name in names:
            spec = Spec(name, args.clients, args.rounds or DEFAULT_ROUNDS[name])
            rows = run_workload(spec, args, Path(tmp))
            w = Workload.load(str(Path(tmp) / f"{name}-{args.clients}.npz"))
            results[f"{name}-{args.clients}"] = print_table(spec, rows, w)
        if any(
            r.get("error", "").startswith("failed") or "timed out" in r.get("error", "")
            for rs in results.values()
            for r in rs
            if r.get("error")
        ):
            keep = Path(tempfile.mkdtemp(prefix="peers-logs-"))
            for log in Path(tmp).glob("*.log"):
                (keep / log.name).write_bytes(log.read_bytes())
            print(f"\nworker logs kept in {keep}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
