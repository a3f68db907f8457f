"""User models that the stacked path once trained wrongly or crashed on (audit of the engine).

Per case: stacked == loop in float64 (<= 1e-10), or the stacked path falls back to the loop with
a one-line reason; and fit -> unlearn -> audit(tolerance=0.0) bit for bit in float32.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from _models import Plain
from _tiny import tiny_data, tiny_trainer
from torch import nn

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, path_choice, stack_params
from fedshard_lightning.engine.optim import round_lr
from fedshard_lightning.errors import ConfigError, ContractError
from fedshard_lightning.module import bind_model


class BatchIdx(Plain):
    """A loss term on odd local steps only."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 0.1 * self.net[0].weight.pow(2).sum() if batch_idx % 2 == 1 else loss


class PaddedEmbedding(Plain):
    """Token ids from the features, an embedding whose row 0 is padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)
        self.net = nn.Linear(8, 4)

    def forward(self, x):
        return self.net(self.emb((x.abs() * 5).long().clamp(max=19)).mean(1))


class FunctionalPadding(Plain):
    """A padding row through ``F.embedding`` in forward: no layer to inspect before training."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(20, 8))
        self.net = nn.Linear(8, 4)

    def forward(self, x):
        ids = (x.abs() * 5).long().clamp(max=19)
        return self.net(F.embedding(ids, self.table, padding_idx=0).mean(1))


class AuxHead(Plain):
    """An auxiliary head that training_step never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(16, 2)


class GRUNet(Plain):
    """A recurrent layer (no vmap batching rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(1, 4, batch_first=True)
        self.net = nn.Linear(4, 4)

    def forward(self, x):
        return self.net(self.rnn(x.unsqueeze(-1))[1][-1])


class LSTMNet(GRUNet):
    """The same with an LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(1, 4, batch_first=True)

    def forward(self, x):
        return self.net(self.rnn(x.unsqueeze(-1))[1][0][-1])


class FrozenFirst(Plain):
    """First layer frozen, optimizer over all of self.parameters() (fine-tuning)."""

    def __init__(self) -> None:
        super().__init__()
        for p in self.net[0].parameters():
            p.requires_grad = False


def _engine(cls, mode, dtype=torch.float64, **kw):
    dm = tiny_data()
    dm.setup()
    torch.manual_seed(0)
    m = cls()
    bind_model(m, dm.input_shape, dm.num_classes)
    return FederatedEngine(
        m.to(dtype), dm, LocalSchedule(batch_size=7, local_epochs=2), seed=1, vectorize=mode, **kw
    )


def _fit(eng):
    groups = [Group(0, (0, 1, 2, 3), 2), Group(1, (4, 5, 6, 7), 1)]
    return eng.train_groups(stack_params([eng.module_params()] * 2), groups, stage=1)


def _both(cls, **kw):
    """Float64 results of both paths, the stacked engine's mode line, and the start."""
    lines: list[str] = []
    out = {}
    for mode in ("always", "never"):
        eng = _engine(cls, mode, **kw)
        eng.on_mode = lines.append
        out[mode] = _fit(eng)
        start = eng.module_params()
    return out["always"], out["never"], lines[0], start


def _max_diff(a, b):
    return max(float((a.params[k] - b.params[k]).abs().max()) for k in a.params)


def _audit(tmp_path, cls, vectorize):
    """Fit, unlearn client 3, audit with tolerance 0.0 (float32); the audit result and fit's history."""

    def trainer():
        return tiny_trainer(tmp_path, vectorize=vectorize)

    def model():
        torch.manual_seed(0)
        return cls()

    tr = trainer()
    tr.fit(model(), tiny_data())
    run = str(tr.run_dir)
    trainer().unlearn(model(), tiny_data(), run, [3])
    res = trainer().audit(model(), tiny_data(), run, tolerance=0.0)
    assert res["passed"] and res["max_abs_diff"] == 0.0
    return tr.history


# (1) batch_idx --------------------------------------------------------------------------------
@pytest.mark.exactness
def test_batch_idx_is_the_local_step_on_the_stacked_path(tmp_path):
    a, b, line, _ = _both(BatchIdx)
    assert "stacked clients, kernel vmap" in line
    assert _max_diff(a, b) <= 1e-10
    _audit(tmp_path, BatchIdx, "always")


# (2) nn.Embedding(padding_idx) ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["always", "auto"])
def test_padded_embedding_falls_back_to_the_loop(mode):
    eng = _engine(PaddedEmbedding, mode)
    lines: list[str] = []
    eng.on_mode = lines.append
    got = _fit(eng)
    want = _fit(_engine(PaddedEmbedding, "never"))
    assert eng.mode == "loop" and len(lines) == 1 and "\n" not in lines[0]
    assert "emb is Embedding(padding_idx=0)" in lines[0]
    assert _max_diff(got, want) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_auto_keeps_the_loop_where_the_two_paths_disagree(dtype):
    """``auto`` compares the paths' losses on its probe: a functional padding_idx shows there."""
    eng = _engine(FunctionalPadding, "auto", dtype=dtype)
    lines: list[str] = []
    eng.on_mode = lines.append
    got = _fit(eng)
    assert eng.mode == "loop", lines
    assert "the stacked clients' losses differ from the per-client loop's by" in lines[0]
    assert _max_diff(got, _fit(_engine(FunctionalPadding, "never", dtype=dtype))) == 0.0
    exact = _engine(Plain, "auto", dtype=dtype)  # an exact model is still timed
    exact.on_mode = lines.append
    _fit(exact)
    assert "timed" in lines[-1], lines[-1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_always_refuses_a_stacked_path_that_disagrees_with_the_loop(dtype, monkeypatch, tmp_path):
    """``always`` skips the timing, not the check: the same functional padding stops in one line."""
    with pytest.raises(ConfigError) as err:
        _fit(_engine(FunctionalPadding, "always", dtype=dtype))
    line = str(err.value)
    assert (
        line.startswith("trainer.vectorize=always: the stacked clients' losses differ") and "\n" not in line
    )
    assert line.endswith("set trainer.vectorize to auto or never")
    a, b, mode_line, _ = _both(Plain)  # an exact model passes the check and trains stacked
    assert "stacked clients" in mode_line and _max_diff(a, b) <= 1e-10
    signature = next(s for s in path_choice.agreed_signatures() if s.startswith("always|"))
    path_choice.agreed_signatures().clear()  # as a new process: the check is kept on disk
    monkeypatch.setattr(path_choice, "_probe_runs", lambda *a: pytest.fail("checked again"))
    _fit(_engine(Plain, "always"))
    assert signature in path_choice.agreed_signatures()


def test_always_checks_on_the_general_path_too():
    """Calls that keep the clients' parameters (no lean path) are checked in their first round."""
    eng = _engine(FunctionalPadding, "always")
    groups = [Group(0, (0, 1, 2, 3), 2)]
    with pytest.raises(ConfigError, match=r"trainer\.vectorize=always"):
        eng.train_groups(stack_params([eng.module_params()]), groups, stage=1, keep_client_params=True)


def test_a_run_s_own_path_is_not_checked_again():
    """Unlearning and audit replay the path the fit recorded: its audit checks it, not a probe."""
    eng = _engine(FunctionalPadding, "always")
    eng.set_mode("stacked")
    _fit(eng)
    assert eng.mode == "stacked"


def test_padded_embedding_audits_bit_exact(tmp_path):
    _audit(tmp_path, PaddedEmbedding, "always")


# (3) a parameter training_step does not use ---------------------------------------------------
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_unused_parameter_gets_no_update_stacked_as_on_the_loop(batch_invariant):
    a, b, line, start = _both(AuxHead, batch_invariant=batch_invariant)
    assert "stacked clients" in line
    assert _max_diff(a, b) <= 1e-10
    for k in ("aux.weight", "aux.bias"):  # no weight decay, no momentum: untouched
        assert torch.equal(a.params[k], start[k].expand_as(a.params[k]))


@pytest.mark.exactness
def test_unused_parameter_audits_bit_exact_stacked(tmp_path):
    _audit(tmp_path, AuxHead, "always")


# (4) layers without a vmap batching rule ------------------------------------------------------
@pytest.mark.parametrize(("cls", "op"), [(GRUNet, "aten::gru"), (LSTMNet, "aten::lstm")])
@pytest.mark.parametrize("mode", ["always", "auto"])
def test_recurrent_layers_fall_back_with_a_reason(cls, op, mode):
    eng = _engine(cls, mode)
    lines: list[str] = []
    eng.on_mode = lines.append
    got = _fit(eng)
    assert eng.mode == "loop" and len(lines) == 1 and "\n" not in lines[0]
    assert op in lines[0] and "no batching rule" in lines[0]
    assert _max_diff(got, _fit(_engine(cls, "never"))) == 0.0


def test_gru_audits_bit_exact_with_always(tmp_path):
    _audit(tmp_path, GRUNet, "always")


# (5) frozen parameters in the optimizer -------------------------------------------------------
def test_frozen_parameters_in_the_optimizer_train_stacked():
    a, b, line, _ = _both(FrozenFirst)
    assert "stacked clients" in line
    assert _max_diff(a, b) <= 1e-10
    assert "net.0.weight" not in a.params


def test_frozen_parameters_audit_bit_exact_stacked(tmp_path):
    _audit(tmp_path, FrozenFirst, "always")


# (6) a torchmetrics Metric logged with self.log -----------------------------------------------
def _metric_model():
    torchmetrics = pytest.importorskip("torchmetrics")

    class WithMetric(Plain):
        def __init__(self) -> None:
            super().__init__()
            self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            self.train_acc(logits, y)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            return F.cross_entropy(logits, y)

    return WithMetric


@pytest.mark.parametrize("mode", ["always", "never"])
def test_logged_metric_trains_stacked_and_logs_its_value(mode):
    cls = _metric_model()
    eng = _engine(cls, mode)
    lines: list[str] = []
    eng.on_mode = lines.append
    got = _fit(eng)
    assert eng.mode == ("stacked" if mode == "always" else "loop") and len(lines) == 1
    acc = [h.metrics["train_acc"] for h in got.history]
    assert all(0.0 <= v <= 1.0 for v in acc)


def test_logged_metric_audits_bit_exact(tmp_path):
    history = _audit(tmp_path, _metric_model(), "always")
    assert "train_acc" in history[0]


# (7) Lightning's scheduler dict keys ----------------------------------------------------------
class _Sched(Plain):
    config: ClassVar[dict] = {}

    def configure_optimizers(self):
        o = torch.optim.SGD(self.parameters(), lr=0.08)
        return {
            "optimizer": o,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1, 0.5), **self.config},
        }


def test_scheduler_frequency_steps_every_n_rounds():
    m = type("Every2", (_Sched,), {"config": {"interval": "epoch", "frequency": 2}})()
    assert [round_lr(m)(r)[0] for r in range(5)] == [0.08, 0.08, 0.04, 0.04, 0.02]
    m = type("Every1", (_Sched,), {"config": {"interval": "epoch"}})()
    assert [round_lr(m)(r)[0] for r in range(3)] == [0.08, 0.04, 0.02]


def test_scheduler_interval_step_refused_in_one_line():
    m = type("PerStep", (_Sched,), {"config": {"interval": "step", "frequency": 2}})()
    with pytest.raises(ContractError, match="interval='step'") as err:
        round_lr(m)
    assert "\n" not in str(err.value)
