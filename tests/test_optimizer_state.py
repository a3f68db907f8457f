"""Client optimizer state: reset every round (said once by fit), or kept (``optimizer_state: keep``), against a plain FedAvg loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _cli import cli
from _tiny import tiny_data, tiny_trainer

from fedshard_lightning.data import DigitsDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


class SmoothedAdamW(MLP):
    """AdamW (lr 3e-3, weight decay 0.05) on cross entropy with label smoothing 0.1."""

    def __init__(self, **kw) -> None:
        super().__init__(hidden=(64, 64), optimizer="adamw", lr=3e-3, weight_decay=0.05, **kw)

    def per_sample_loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none", label_smoothing=0.1)


def test_adamw_with_label_smoothing_learns_digits_with_its_state_reset_each_round(tmp_path):
    algorithm = FedShard(merge_rate=2, merge="a1", rounds="a2", t0=2, t1=8, batch_size=10, local_epochs=2)
    data = DigitsDataModule(num_clients=32, partition="dirichlet", rho=0.5, min_client_size=10, seed=0)
    trainer = FederatedTrainer(algorithm=algorithm, default_root_dir=str(tmp_path), enable_progress_bar=False)
    torch.manual_seed(0)
    assert trainer.fit(SmoothedAdamW(), data)["test_accuracy"] >= 0.85


def _fedavg_reference(model, dm, engine, clients, rounds, keep):
    """FedAvg written out: each client an optimizer of its own, kept (or made anew) across rounds."""
    glob = {n: p.detach().clone() for n, p in model.named_parameters()}
    workers = {c: copy.deepcopy(model) for c in clients}
    opts = {c: workers[c].configure_optimizers() for c in clients}
    sizes = [dm.client_sizes[c] for c in clients]
    for r in range(rounds):
        gidx, bsz, steps = engine.local.schedules(ClientBatch(list(clients), [0] * len(clients), 1, r))
        finals = []
        for i, c in enumerate(clients):
            worker = workers[c]
            with torch.no_grad():
                for n, p in worker.named_parameters():
                    p.copy_(glob[n])
            opt = opts[c] if keep else worker.configure_optimizers()
            for s in range(int(steps[i])):
                x, y = dm.gather(torch.as_tensor(gidx[i, s, : bsz[i, s]]), torch.float64)
                opt.zero_grad()
                F.cross_entropy(worker(x), y).backward()
                opt.step()
            finals.append({n: p.detach().clone() for n, p in worker.named_parameters()})
        total = float(sum(sizes))
        glob = {n: sum(f[n] * (w / total) for f, w in zip(finals, sizes)) for n in glob}
    return glob


@pytest.mark.parametrize("optimizer", ["adam", "sgd-momentum"])
def test_keep_equals_fedavg_with_persistent_client_optimizers_float64(optimizer):
    dm = tiny_data(k=5)
    dm.setup()
    torch.manual_seed(0)
    kw = (
        dict(optimizer="adam", lr=0.01)
        if optimizer == "adam"
        else dict(optimizer="sgd", lr=0.1, momentum=0.9)
    )
    model = MLP(hidden=(8,), **kw)
    model.bind_data(dm.input_shape, dm.num_classes)
    model = model.double()
    engine = FederatedEngine(
        model, dm, LocalSchedule(batch_size=7, local_epochs=1), seed=2, optimizer_state="keep"
    )
    clients = tuple(range(5))
    init = stack_params([engine.module_params()])
    got = engine.train_groups(init, [Group(0, clients, 3)], stage=1).params
    assert engine.mode == "loop"
    kept = _fedavg_reference(model, dm, engine, clients, 3, keep=True)
    fresh = _fedavg_reference(model, dm, engine, clients, 3, keep=False)
    assert max(float((got[n][0] - kept[n]).abs().max()) for n in kept) <= 1e-12
    assert max(float((got[n][0] - fresh[n]).abs().max()) for n in kept) > 1e-6  # keeping changed it
    again = engine.train_groups(init, [Group(0, clients, 3)], stage=1).params  # each call starts fresh
    assert all(torch.equal(again[n], got[n]) for n in got)


def test_keep_fit_unlearn_and_audit_are_bit_exact(tmp_path, capsys):
    def fresh():
        torch.manual_seed(0)
        return MLP(hidden=(16,), optimizer="adamw", lr=0.01, weight_decay=0.05), tiny_data()

    def trainer():
        return tiny_trainer(tmp_path, rounds=3, optimizer_state="keep")

    tr = trainer()
    tr.fit(*fresh())
    assert "reset every round" not in capsys.readouterr().out
    trainer().unlearn(*fresh(), str(tr.run_dir), [2, 5])
    assert trainer().audit(*fresh(), str(tr.run_dir))["max_abs_diff"] == 0.0
    with pytest.raises(Exception, match=r"another trainer\.optimizer_state"):
        tiny_trainer(tmp_path, rounds=3).unlearn(*fresh(), str(tr.run_dir), [1])


def test_keep_with_a_stateless_optimizer_is_one_line_exit_2_nothing_written(tmp_path):
    root = tmp_path / "runs"
    code, _, err = cli(
        [
            "fit",
            "--trainer.optimizer_state",
            "keep",
            "--trainer.default_root_dir",
            str(root),
        ]  # digits: plain SGD
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "optimizer_state=keep: the client optimizer SGD keeps no state" in err
    assert not root.exists() or not any(root.iterdir())


@pytest.mark.parametrize(
    "kw,named",
    [
        (dict(optimizer="adamw", lr=0.01, weight_decay=0.05), "AdamW keeps state (exp_avg, exp_avg_sq)"),
        (dict(optimizer="sgd", lr=0.1, momentum=0.5), "SGD keeps state (momentum_buffer)"),
        (dict(optimizer="sgd", lr=0.1), None),
    ],
)
def test_fit_names_the_state_that_each_round_resets(tmp_path, capsys, kw, named):
    torch.manual_seed(0)
    tiny_trainer(tmp_path).fit(MLP(hidden=(8,), **kw), tiny_data())
    notes = [line for line in capsys.readouterr().out.splitlines() if "reset every round" in line]
    if named is None:
        assert notes == []
    else:
        assert len(notes) == 1 and named in notes[0], notes
