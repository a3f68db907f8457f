"""The layers users write train stacked: attention with its dropout, LayerNorm, GELU, torchmetrics.

References: the per-client loop in float64 (stacked == loop <= 1e-10), PyTorch's own
``nn.MultiheadAttention`` (the keyed form equals it where no dropout is drawn), a client trained
alone (neighbour independence, bit for bit in float32), and fit -> unlearn -> audit(tolerance=0.0)
in float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import Plain
from _tiny import tiny_data, tiny_trainer
from torch import nn

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.attention import keyed_attention
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.module import bind_model

torchmetrics = pytest.importorskip("torchmetrics")


class TinyTransformer(Plain):
    """Five tokens of two features, a post-norm GELU encoder layer with dropout, LayerNorm, AdamW."""

    def __init__(self, dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 8)
        self.enc = nn.TransformerEncoderLayer(
            8, nhead=2, dim_feedforward=16, dropout=dropout, activation="gelu", batch_first=True
        )
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.enc(self.embed(x.view(x.shape[0], 5, 2)))
        return self.head(self.norm(h).mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.05)


class BiasKVAttention(TinyTransformer):
    """Attention with ``add_bias_kv``, which the keyed form does not compute: the loop trains it."""

    def __init__(self) -> None:
        super().__init__()
        self.enc.self_attn = nn.MultiheadAttention(8, 2, dropout=0.2, add_bias_kv=True, batch_first=True)


class NoisyInput(Plain):
    """Noise drawn in forward with torch.randn_like: the loop trains it, and the reason names this line."""

    def forward(self, x):
        return self.net(x + 0.1 * torch.randn_like(x))


class MetricMLP(Plain):
    """GELU and LayerNorm, a torchmetrics accuracy called and logged in the step, Adam + StepLR dict."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4)
        self.train_f1 = torchmetrics.classification.MulticlassF1Score(num_classes=4, average="macro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.train_f1.update(logits, y)
        self.log("train_f1", self.train_f1.compute())
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.02)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}}


LOGGED = {TinyTransformer: {"train_loss"}, MetricMLP: {"train_acc", "train_f1"}}


def _engine(cls, mode, dtype=torch.float64):
    dm = tiny_data()
    dm.setup()
    torch.manual_seed(0)
    m = cls()
    bind_model(m, dm.input_shape, dm.num_classes)
    return FederatedEngine(m.to(dtype), dm, LocalSchedule(batch_size=7), seed=1, vectorize=mode)


def _fit(eng):
    groups = [Group(0, (0, 1, 2, 3), 2), Group(1, (4, 5, 6, 7), 1)]
    return eng.train_groups(stack_params([eng.module_params()] * 2), groups, stage=1)


@pytest.mark.parametrize("cls", [TinyTransformer, MetricMLP])
def test_trains_stacked_and_equals_the_loop_float64(cls):
    runs, lines = {}, []
    for mode in ("always", "never"):
        eng = _engine(cls, mode)
        eng.on_mode = lines.append
        runs[mode] = _fit(eng)
        assert eng.mode == ("stacked" if mode == "always" else "loop")
    assert "stacked clients" in lines[0] and "loop" not in lines[0]
    a, b = runs["always"], runs["never"]
    assert max(float((a.params[k] - b.params[k]).abs().max()) for k in a.params) <= 1e-10
    for ha, hb in zip(a.history, b.history, strict=True):
        assert set(ha.metrics) == set(hb.metrics) == LOGGED[cls]
        for k in ha.metrics:
            assert abs(ha.metrics[k] - hb.metrics[k]) <= 1e-10


@pytest.mark.parametrize("cls", [TinyTransformer, MetricMLP])
def test_auto_times_the_paths_instead_of_falling_back(cls, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path))
    eng = _engine(cls, "auto", torch.float32)
    lines: list[str] = []
    eng.on_mode = lines.append
    _fit(eng)
    assert "vectorize: auto; timed" in lines[0]


@pytest.mark.parametrize("cls", [TinyTransformer, MetricMLP])
def test_client_result_independent_of_chunk_neighbours(cls):
    eng = _engine(cls, "always", torch.float32)
    eng._mode = "stacked"
    start = stack_params([eng.module_params()])
    alone = eng._run_local(start, torch.zeros(1, dtype=torch.long), ClientBatch([1], [0], 1, 0))
    for cl in ([1, 2, 3, 7], [7, 6, 5, 4, 3, 2, 0, 1]):
        res = eng._run_local(
            start, torch.zeros(len(cl), dtype=torch.long), ClientBatch(cl, [0] * len(cl), 1, 0)
        )
        i = cl.index(1)
        for k in alone.params:
            assert torch.equal(alone.params[k][0], res.params[k][i]), (cl, k)
        for k in alone.logs:
            assert torch.equal(alone.logs[k][0], res.logs[k][i]), (cl, k)


def test_attention_dropout_is_keyed_and_active():
    with_dropout = _fit(_engine(TinyTransformer, "always"))
    eng = _engine(TinyTransformer, "always")
    eng.module.enc.self_attn.dropout = 0.0  # the encoder's own nn.Dropout layers stay
    without = _fit(eng)
    assert max(float((with_dropout.params[k] - without.params[k]).abs().max()) for k in without.params) > 1e-6


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "padding", "float", "causal"])
def test_keyed_attention_equals_pytorch_without_dropout(batch_first, masks):
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=6, vdim=6).double()
    q = torch.randn(3, 4, 8, dtype=torch.float64)
    kv = torch.randn(3, 5, 6, dtype=torch.float64)
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    kw = {}
    if masks == "padding":
        kw["key_padding_mask"] = torch.tensor(
            [[False] * 4 + [True], [False] * 5, [True, False] * 2 + [False]]
        )
    elif masks == "float":
        kw["attn_mask"] = torch.randn(4, 5, dtype=torch.float64)
    elif masks == "causal":
        kw["attn_mask"] = torch.ones(4, 5, dtype=torch.bool).triu(1)
    want_out, want_w = layer(q, kv, kv, **kw)
    got_out, got_w = keyed_attention(layer, lambda x, p: x, q, kv, kv, **kw)
    assert torch.allclose(got_out, want_out, rtol=0, atol=1e-12)
    assert torch.allclose(got_w, want_w, rtol=0, atol=1e-12)
    got_out, none = keyed_attention(layer, lambda x, p: x, q, kv, kv, need_weights=False, **kw)
    assert none is None and torch.allclose(got_out, want_out, rtol=0, atol=1e-12)


def test_attention_outside_the_keyed_form_falls_back_naming_the_layer():
    eng = _engine(BiasKVAttention, "always")
    lines: list[str] = []
    eng.on_mode = lines.append
    _fit(eng)
    assert eng.mode == "loop"
    assert "BiasKVAttention.enc.self_attn is nn.MultiheadAttention(add_bias_kv=True" in lines[0]
    assert "\n" not in lines[0]


def test_a_loop_fallback_names_the_user_s_own_line():
    eng = _engine(NoisyInput, "always")
    lines: list[str] = []
    eng.on_mode = lines.append
    _fit(eng)
    assert eng.mode == "loop" and "\n" not in lines[0]
    assert "NoisyInput.forward at test_common_layers.py:" in lines[0]
    assert "torch.randn_like(x)" in lines[0]


def test_metric_state_is_per_client_and_left_as_it_was():
    eng = _engine(MetricMLP, "always")
    res = _fit(eng)
    assert eng.mode == "stacked"
    m = eng.module.train_acc
    assert m._update_count == 0 and int(m.tp.sum()) == 0  # training left the user's metric alone
    acc = [h.metrics["train_acc"] for h in res.history]
    assert all(0.0 <= v <= 1.0 for v in acc)
    x = torch.randn(6, 10, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    m(eng.module(x), y)  # outside a step: torchmetrics' own forward
    assert m._update_count == 1


@pytest.mark.exactness
@pytest.mark.parametrize("cls", [TinyTransformer, MetricMLP])
def test_fit_unlearn_audit_bit_exact_stacked(tmp_path, cls, capsys):
    def trainer():
        return tiny_trainer(tmp_path, vectorize="always")

    def model():
        torch.manual_seed(0)
        return cls()

    tr = trainer()
    tr.fit(model(), tiny_data())
    assert LOGGED[cls] <= set(tr.history[0])
    assert "local training: stacked clients" in capsys.readouterr().out
    run = str(tr.run_dir)
    trainer().unlearn(model(), tiny_data(), run, [3])
    res = trainer().audit(model(), tiny_data(), run, tolerance=0.0)
    assert res["passed"] and res["max_abs_diff"] == 0.0
