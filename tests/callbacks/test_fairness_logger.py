"""FairnessLogger: M_e and M_p in every run, read back from the CSV and the offline W&B run, against numpy."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from _cli import cli
from _tiny import small_synthetic
from test_loggers import _segments

from fedshard_lightning import FederatedTrainer
from fedshard_lightning.callbacks import FairnessLogger, UnlearningReplay
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.metrics.client_alpha import per_client_accuracy
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedShard

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _replay_as_shipped(monkeypatch):
    """The suite's conftest turns M_p's replay off; here the shipped client-step budget decides.

    The seconds budget (120 s at the fit's measured speed) is lifted: on a loaded machine the fit
    runs several times slower and the replay would be skipped for the load, not for its size.
    """
    monkeypatch.setenv("FEDSHARD_REPLAY_BUDGET_S", "86400")


def _numpy_m_e(costs, alphas, eps=1e-6) -> float:
    """Paper eq. 7: mean of (Z_avg - Z_c)^2 / max(|alpha_c|, eps)."""
    z, a = np.asarray(costs, dtype=np.float64), np.asarray(alphas, dtype=np.float64)
    return float(np.mean((z.mean() - z) ** 2 / np.maximum(np.abs(a), eps)))


def _numpy_m_p(drop, alphas, leaving: int, eps0=0.01, eps1=1e-12) -> float:
    """Paper eq. 6 for one request: f(x~, y~) = (x~ + y~)(1/x~ + 1/y~), y_c = nearest remaining alpha."""
    x, a = np.asarray(drop, dtype=np.float64), np.asarray(alphas, dtype=np.float64)
    rest = np.delete(a, leaving)
    y = np.abs(a[:, None] - rest[None, :]).min(axis=1)

    def norm(v):
        return eps0 + (v - v.min()) / (v.max() - v.min() + eps1)

    xn, yn = norm(x), norm(y)
    return float(np.mean((xn + yn) * (1 / xn + 1 / yn)))


def _wandb_run(run_dir: Path) -> tuple[dict, list[dict], Path]:
    """(summary, history rows, files folder) of the run's one offline W&B segment."""
    from callbacks.test_replay import _wandb_records

    offline = sorted((run_dir / "wandb_files").rglob("offline-run-*"))
    assert len(offline) == 1, offline
    summary = {}
    for record in _wandb_records(next(offline[0].glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    (_, history), *_ = _segments(run_dir)
    return summary, history, offline[0] / "files"


def _table(history: list[dict], files: Path, key: str = "fairness/clients") -> list[dict]:
    """The last logged W&B table under ``key``, as dicts."""
    row = [h for h in history if f"{key}/path" in h][-1]
    table = json.loads((files / row[f"{key}/path"]).read_text())
    return [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]


@pytest.mark.parametrize(
    ("n", "size"),
    [
        # configs/digits.yaml at 8 clients, at most 3 rounds a shard (rounds: auto's cap)
        pytest.param(8, ["--data.num_clients", "8", "--trainer.algorithm.max_rounds", "3"], id="8-clients"),
        # as shipped (32 clients, up to 30 rounds a shard): its replay fits the client-step budget
        pytest.param(32, [], id="as-shipped", marks=pytest.mark.slow),
    ],
)
def test_plain_digits_fit_logs_m_e_and_m_p_to_wandb_equal_to_numpy_of_its_per_client_costs(tmp_path, n, size):
    root = tmp_path / "runs"
    code, out, err = cli(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "digits.yaml"),
            *size,
            "--trainer.wandb",
            "true",
            "--trainer.default_root_dir",
            str(root),
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("fairness: M_p")]
    assert line.startswith(f"fairness: M_p replays {n} single-client requests: "), out
    (run,) = root.iterdir()
    summary, history, files = _wandb_run(run)
    logged = {k: v for h in history for k, v in h.items() if k.startswith("fairness/")}
    clients = _table(history, files)
    assert [c["client"] for c in clients] == list(range(n))
    z = [c["Z_steps"] for c in clients]
    alphas = [c["alpha"] for c in clients]
    assert logged["fairness/M_e_steps"] == pytest.approx(_numpy_m_e(z, alphas), rel=1e-12)
    assert summary["fairness/M_e_steps"] == logged["fairness/M_e_steps"]
    assert logged["fairness/Z_steps_mean"] == pytest.approx(np.mean(z))
    assert logged["fairness/Z_steps_std"] == pytest.approx(np.std(z))
    assert logged["fairness/replay_client_steps"] == sum(z)
    assert f"{sum(z):,.0f} client-steps predicted" in line
    assert logged["fairness/M_p_skipped"] == 0.0
    assert logged["fairness/M_p"] == pytest.approx(np.mean([c["M_p_request"] for c in clients]), rel=1e-12)
    assert logged["fairness/M_p"] > 2.0  # f(x, y) >= 2 for every client, so is the mean
    # Readable without a .wandb parser: the config and the summary beside the offline run.
    (folder,) = (run / "wandb_files").rglob("offline-run-*")
    plain = json.loads((folder / "summary.json").read_text())
    assert (
        plain["fairness/M_e_steps"] == logged["fairness/M_e_steps"]
        and plain["fairness/M_p"] == logged["fairness/M_p"]
    )
    assert json.loads((folder / "config.json").read_text())["method"] == "fedshard"
    hist = [h for h in history if "fairness/Z_steps/_type" in h][-1]
    assert hist["fairness/Z_steps/_type"] == "histogram" and sum(hist["fairness/Z_steps/values"]) == n
    # The CSV holds the same scalars.
    with open(run / "logs" / "metrics.csv", newline="") as f:
        row = [r for r in csv.DictReader(f) if r.get("fairness/M_e_steps")][-1]
    assert float(row["fairness/M_e_steps"]) == pytest.approx(logged["fairness/M_e_steps"], rel=1e-12)
    assert float(row["fairness/M_p"]) == pytest.approx(logged["fairness/M_p"], rel=1e-12)


def _trainer(root, wandb: bool = False, callbacks=None, **kw) -> FederatedTrainer:
    return FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=4),
        default_root_dir=str(root),
        enable_progress_bar=False,
        vectorize="always",
        wandb=wandb,
        callbacks=callbacks,
        seed=3,
        **kw,
    )


def test_m_p_equals_numpy_of_each_request_s_accuracy_drops(run_root):
    fairness = FairnessLogger()
    trainer = _trainer(run_root, callbacks=[fairness])
    data = small_synthetic()
    trainer.fit(MLP(hidden=(8,), lr=0.1), data)
    res, alg = fairness.result, trainer.algorithm
    assert res.clients == list(range(8)) and res.costs["steps"] == [alg.predict_cost([c]) for c in range(8)]
    before = per_client_accuracy(trainer.module, alg.current_params(), data).numpy()
    state = alg.state_dict()
    for c in range(8):
        _, out = alg.what_if(state, [c])
        drop = before - per_client_accuracy(trainer.module, out.params, data).numpy()
        assert res.m_p_request[c] == pytest.approx(_numpy_m_p(np.nan_to_num(drop), res.alphas, c), rel=1e-9)
    assert res.m_p == pytest.approx(np.mean(list(res.m_p_request.values())), rel=1e-12)
    assert res.m_e["steps"] == pytest.approx(_numpy_m_e(res.costs["steps"], res.alphas), rel=1e-12)


def test_over_budget_m_p_is_one_line_and_logged_as_skipped(run_root, capsys):
    trainer = _trainer(run_root, callbacks=[FairnessLogger(replay_budget=0.5)])
    trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("fairness:")]
    assert len(skipped) == 1 and "M_p skipped" in skipped[0] and "replay_budget=0.5" in skipped[0], out
    with open(trainer.run_dir / "logs" / "metrics.csv", newline="") as f:
        row = [r for r in csv.DictReader(f) if r.get("fairness/M_e_steps")][-1]
    assert row["fairness/M_p_skipped"] == "1.0" and row.get("fairness/M_p", "") == ""


def test_unlearn_updates_the_metrics_for_the_clients_that_remain(run_root):
    fairness = FairnessLogger()
    trainer = _trainer(run_root, wandb=True, callbacks=[fairness])
    trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    run = trainer.run_dir
    again = _trainer(run_root, wandb=True, callbacks=[fairness])
    again.unlearn(MLP(hidden=(8,), lr=0.1), small_synthetic(), ckpt_path=str(run), clients=[2])
    res, alg = fairness.result, again.algorithm
    assert res.clients == [0, 1, 3, 4, 5, 6, 7]
    assert res.costs["steps"] == [alg.predict_cost([c]) for c in res.clients]
    history = [row for _, rows in _segments(run) for row in rows]
    last = [h for h in history if "fairness/M_e_steps" in h][-1]
    assert last["fairness/num_clients"] == 7.0 and "unlearn/client_steps" in {k for h in history for k in h}
    assert last["fairness/M_e_steps"] == pytest.approx(_numpy_m_e(res.costs["steps"], res.alphas), rel=1e-12)
    assert last["fairness/M_p"] == pytest.approx(res.m_p)


def test_the_default_is_on_and_a_replay_or_enable_fairness_false_takes_its_place(run_root):
    from fedshard_lightning.callbacks import default_callbacks

    assert any(isinstance(c, FairnessLogger) for c in default_callbacks([], False))
    assert not any(isinstance(c, FairnessLogger) for c in default_callbacks([], False, fairness=False))
    assert not any(isinstance(c, FairnessLogger) for c in default_callbacks([UnlearningReplay()], False))
    mine = FairnessLogger(replay_budget=0)
    assert [c for c in default_callbacks([mine], False) if isinstance(c, FairnessLogger)] == [mine]


def test_bad_budget_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"FairnessLogger\.replay_budget=-1"):
        FairnessLogger(replay_budget=-1)
    code, _, err = cli(
        [
            "fit",
            "--trainer.callbacks+=fedshard_lightning.callbacks.FairnessLogger",
            "--trainer.callbacks.replay_budget=-1",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    assert code == 2 and err.count("\n") == 1 and "FairnessLogger.replay_budget=-1" in err, err


def test_a_replay_over_the_seconds_budget_is_skipped_in_one_line(run_root, capsys):
    fairness = FairnessLogger(replay_budget_s=0)  # any replay takes more than 0 s at the fit's speed
    trainer = _trainer(run_root, callbacks=[fairness])
    trainer.fit(MLP(hidden=(8,), lr=0.1), small_synthetic())
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("fairness:")]
    assert len(skipped) == 1 and "M_p skipped" in skipped[0] and "replay_budget_s=0" in skipped[0], out
    assert fairness.result.m_p is None and fairness.result.m_e["steps"] > 0


def test_the_seconds_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("FEDSHARD_REPLAY_BUDGET_S", "7.5")
    assert FairnessLogger().replay_budget_s == 7.5
    assert FairnessLogger(replay_budget_s=None).replay_budget_s is None
    monkeypatch.delenv("FEDSHARD_REPLAY_BUDGET_S")
    assert FairnessLogger().replay_budget_s == 120.0
    monkeypatch.setenv("FEDSHARD_REPLAY_BUDGET_S", "soon")
    with pytest.raises(ConfigError, match="FEDSHARD_REPLAY_BUDGET_S='soon'"):
        FairnessLogger()
