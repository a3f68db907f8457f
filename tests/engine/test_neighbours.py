"""A model whose stacked bits depend on the neighbouring clients trains on the loop (auto) or is refused (always).

On the CPU, float32 ``sigmoid`` rounds a tensor's vectorized body and scalar tail differently, so
a client's hidden activations (5 samples x 15 units, not a multiple of the vector width) got
other bits alone than among 7 others, and the digits audit (an independent retrain without the
client) missed by 1.5e-7. The fx kernel now applies it per client (``test_per_client_ops.py``);
under ``vmap`` (an overridden ``training_step``) it still depends on the neighbours, which the
probe catches. ReLU rounds nowhere: it stays stacked and bit-exact.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_data, tiny_model, tiny_trainer
from torch import nn

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, LocalSchedule, stack_params
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.engine.neighbours import neighbour_dependence
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.models import MLP


class VmapSiLUMLP(MLP):
    """The tiny MLP with SiLU and its own ``training_step``, so it trains under ``vmap`` (no per-client form)."""

    def __init__(self, hidden: tuple[int, ...] = (15,), **kwargs) -> None:
        super().__init__(hidden=hidden, **kwargs)

    def configure_model(self) -> None:
        super().configure_model()
        self.net = nn.Sequential(*[nn.SiLU() if isinstance(m, nn.ReLU) else m for m in self.net])

    def training_step(self, batch, batch_idx=0):
        return self.per_sample_loss(batch).mean()


def _model(cls: type) -> nn.Module:
    torch.manual_seed(0)
    return cls(hidden=(15,), lr=0.1)


def _data() -> SyntheticDataModule:
    return tiny_data()  # on digits the vmap path's probe happened to find no dependence


def _fit_unlearn_audit(root, cls: type, vectorize: str, capsys) -> tuple[dict, str]:
    """Batch 5 x 15 hidden units per client: fit, unlearn client 3, audit."""
    tiny_trainer(root, vectorize=vectorize, run_name="r").fit(_model(cls), _data())
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("local training"))
    tiny_trainer(root, vectorize=vectorize, run_name="r").unlearn(_model(cls), _data(), root / "r", [3])
    return tiny_trainer(root, vectorize=vectorize, run_name="r").audit(_model(cls), _data(), root / "r"), line


@pytest.fixture(autouse=True)
def _no_kept_decisions(monkeypatch):
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", "")


def test_position_dependent_activation_runs_on_the_loop_and_audits_bit_exact(tmp_path, capsys):
    res, line = _fit_unlearn_audit(tmp_path, VmapSiLUMLP, "auto", capsys)
    assert res["max_abs_diff"] == 0.0 and res["passed"]  # 1e-7 on the stacked path before
    assert line.startswith("local training: per-client loop"), line
    assert (
        "depend on the neighbouring clients" in line and "float32 unlearning would not be bit-exact" in line
    )


def test_always_refuses_it_in_one_line(tmp_path, capsys):
    with pytest.raises(
        ConfigError, match=r"vectorize=always: stacked results depend on the neighbouring"
    ) as err:
        _fit_unlearn_audit(tmp_path, VmapSiLUMLP, "always", capsys)
    assert "set trainer.vectorize to auto or never" in str(err.value) and "\n" not in str(err.value)


def test_relu_stays_stacked_and_bit_exact(tmp_path, capsys):
    res, line = _fit_unlearn_audit(tmp_path, MLP, "always", capsys)
    assert line.startswith("local training: stacked clients"), line
    assert res["passed"] and res["max_abs_diff"] == 0.0


def test_probe_only_where_the_engine_promises_invariance():
    dm = tiny_data()
    dm.setup()
    m = tiny_model(VmapSiLUMLP)
    m.bind_data(dm.input_shape, dm.num_classes)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize="always")
    eng._mode = "stacked"
    start = stack_params([eng.module_params()] * 8)
    batch = ClientBatch(list(range(8)), [0] * 8, 0, 0)
    assert neighbour_dependence(eng.local, start, batch) is None  # not asked: batch_invariant off
    eng.local.neighbour_run = eng._stacked_call
    # Whether this CPU's kernels round a vmap SiLU by row depends on its vector units and MKL's
    # mode; a run that adds its row index makes the dependence certain on any machine.
    first_row = {}

    def by_row(state, b):
        res = eng._stacked_call(state, b)
        for name, value in res.params.items():
            rows = torch.arange(value.shape[0], dtype=value.dtype).reshape(-1, *[1] * (value.dim() - 1))
            res.params[name] = value + 1e-3 * rows
        first_row.setdefault("seen", True)
        return res

    eng.local.neighbour_run = by_row
    assert "client" in neighbour_dependence(eng.local, start, batch)
    eng.local.neighbour_run = eng._stacked_call
    assert first_row
