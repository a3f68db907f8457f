"""UnlearningReplay and StageMergeLogger: costs, restored state, files, plots and the W&B report."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_limits

from fedshard_lightning.callbacks import FederatedCallback, StageMergeLogger, UnlearningReplay
from fedshard_lightning.callbacks.replay import CLIENT_COLUMNS
from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared, loaded 2-core CPU torch's and OpenMP's threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    torch.set_num_threads(threads)


def _make(root: Path, k: int, callbacks, wandb: bool = False, **alg):
    alg.setdefault("rounds", "fixed")
    alg.setdefault("fixed_rounds", 2)
    alg.setdefault("batch_size", 4)
    dm = SyntheticDataModule(
        num_clients=k,
        partition="dirichlet",
        rho=0.5,
        min_client_size=4,
        num_samples=14 * k,
        num_test=60,
        shape=(6,),
        num_classes_=3,
    )
    trainer = FederatedTrainer(
        algorithm=FedShard(**alg),
        precision="64-true",
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=1,
        vectorize="always",
        callbacks=callbacks,
        wandb=wandb,
    )
    return trainer, MLP(hidden=(8,), lr=0.1, momentum=0.5), dm


class Snapshot(FederatedCallback):
    """Records the run's files and the algorithm's in-memory state at on_fit_end."""

    def __init__(self):
        self.state = None

    def on_fit_end(self, trainer, metrics):
        self.state = snapshot(trainer)


def snapshot(trainer) -> dict:
    run = trainer.run_dir
    cache = run / "cache"
    current = (cache / "CURRENT").read_bytes()
    version = cache / json.loads(current)["version"]
    return {
        "model": hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest(),
        "CURRENT": current,
        "manifest": (version / "manifest.json").read_bytes(),
        "versions": sorted(p.name for p in cache.iterdir()),
        "params": {k: v.clone() for k, v in trainer.algorithm.current_params().items()},
        "models": [{k: v.clone() for k, v in m.items()} for m in trainer.algorithm.models],
        "unlearned": list(trainer.algorithm.unlearned),
    }


def assert_same(a: dict, b: dict) -> None:
    for key in ("model", "CURRENT", "manifest", "versions", "unlearned"):
        assert a[key] == b[key], key
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    for ma, mb in zip(a["models"], b["models"], strict=True):
        for k in ma:
            assert torch.equal(ma[k], mb[k]), k


def test_predicted_costs_equal_measured_and_state_is_restored(run_root):
    predicted = UnlearningReplay(mode="predicted", mia=False, plots=False)
    measured = UnlearningReplay(mode="measured", mia=False, plots=False)
    before, after = Snapshot(), Snapshot()
    trainer, model, dm = _make(run_root, 16, [before, predicted, measured, after])
    trainer.fit(model, dm)

    # Z_c predicted without training equals the client-steps of actually unlearning c, for every client.
    assert len(measured.rows) == 16 and all(r["measured"] for r in measured.rows)
    for p_row, m_row in zip(predicted.rows, measured.rows, strict=True):
        assert p_row["client"] == m_row["client"]
        assert (
            p_row["Z_steps"] == p_row["Z_steps_predicted"] == m_row["Z_steps"] == m_row["Z_steps_predicted"]
        )
        assert m_row["Z_seconds"] > 0
    assert len({r["Z_steps"] for r in measured.rows}) > 1, "clients of different sizes cost differently"
    assert predicted.summary["M_e_steps"] == pytest.approx(measured.summary["M_e_steps"], rel=1e-12)

    # Measured mode unlearned 16 clients and restored the committed state after each: the files
    # and the in-memory state are exactly those of the fitted run, before and after the callback.
    assert_same(before.state, after.state)
    assert_same(before.state, snapshot(trainer))

    s = measured.summary
    assert s["clients_unlearned"] == 16 and s["M_e"] == s["M_e_seconds"] > 0
    assert math.isfinite(s["M_p"]) and s["M_p"] >= 4.0
    assert s["unlearn_client_steps_mean"] == pytest.approx(np.mean([r["Z_steps"] for r in measured.rows]))
    p = predicted.summary
    assert p["M_p"] is None and p["M_e_seconds"] is None and p["clients_unlearned"] == 0
    assert p["M_e"] == p["M_e_steps"]

    out = trainer.run_dir / "fairness"
    with open(out / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CLIENT_COLUMNS and len(rows) == 16
    for row, mine in zip(rows, measured.rows, strict=True):
        assert int(row["Z_steps"]) == mine["Z_steps"]
        assert float(row["delta_acc"]) == pytest.approx(float(row["acc_before"]) - float(row["acc_after"]))
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "M_e",
        "M_p",
        "mia_f1_before",
        "mia_f1_after",
        "mia_auc_before",
        "mia_auc_after",
        "unlearn_seconds_mean",
        "unlearn_client_steps_mean",
    ):
        assert key in summary
    assert summary["M_p"] == pytest.approx(s["M_p"])
    # The scalars reached the CSV logger.
    logged = (trainer.run_dir / "logs" / "metrics.csv").read_text().splitlines()[0]
    assert "fairness/M_e" in logged and "fairness/M_p" in logged


def _wandb_records(path: Path):
    """Records of a .wandb file (LevelDB-style log of protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):
            buf = chunk
        elif kind == 3:
            buf += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf + chunk if kind == 4 else buf)
            yield record


def _assert_real_image(path: Path, min_h: int, min_w: int) -> None:
    from matplotlib.image import imread

    img = imread(str(path))
    assert img.ndim == 3 and img.shape[0] >= min_h and img.shape[1] >= min_w, img.shape
    flat = img[..., :3].reshape(-1, 3)
    assert float(flat.std()) > 0.05
    assert len(np.unique((flat * 255).astype(np.uint8), axis=0)) > 20


def test_wandb_offline_report(run_root):
    replay = UnlearningReplay(mode="measured", sample=3, seed=1)
    merges = StageMergeLogger()
    trainer, model, dm = _make(run_root, 8, [replay, merges], wandb=True)
    trainer.fit(model, dm)
    run = trainer.run_dir
    summary = json.loads((run / "fairness" / "summary.json").read_text())
    assert summary["clients_unlearned"] == 3 and summary["mia_f1_before"] is not None
    assert summary["mia_f1"] == summary["mia_f1_after"] is not None
    assert 0.0 <= summary["mia_auc_before"] <= 1.0 and 0.0 <= summary["mia_auc_after"] <= 1.0

    # The PNGs are real plots.
    _assert_real_image(run / "fairness" / "cost_distribution.png", 300, 800)
    _assert_real_image(run / "fairness" / "round_accuracy.png", 300, 600)

    # The offline W&B run: summary keys, the table and both images.
    offline = sorted((run / "wandb_files").rglob("offline-run-*"))
    assert len(offline) == 1, offline
    files = offline[0] / "files"
    run_summary, history = {}, {}
    for record in _wandb_records(next(offline[0].glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        items = (
            record.summary.update if kind == "summary" else record.history.item if kind == "history" else []
        )
        for item in items:
            key = item.key or "/".join(item.nested_key)
            (run_summary if kind == "summary" else history)[key] = json.loads(item.value_json)
    for key in ("M_e", "M_p", "mia_f1", "unlearn_seconds_mean"):
        assert run_summary[key] == pytest.approx(summary[key]), key
    assert history["fairness/clients/_type"] == "table-file"
    table = json.loads((files / history["fairness/clients/path"]).read_text())
    assert table["columns"] == list(CLIENT_COLUMNS) and len(table["data"]) == 8
    for name in ("cost_distribution", "round_accuracy"):
        assert history[f"fairness/{name}/_type"] == "image-file"
        image = files / history[f"fairness/{name}/path"]
        assert image.read_bytes() == (run / "fairness" / f"{name}.png").read_bytes()
    assert history["fairness/clients_unlearned"] == 3 or run_summary["fairness/clients_unlearned"] == 3

    # StageMergeLogger: one line per stage with the grouping, the clients, alphas and rounds.
    lines = [json.loads(x) for x in (run / "merges.jsonl").read_text().splitlines()]
    assert [x["stage"] for x in lines] == [1, 2, 3]
    assert [len(x["groups"]) for x in lines] == [4, 2, 1]
    assert sorted(c for g in lines[1]["clients"] for c in g) == list(range(8))
    assert all(len(x["children_alphas"]) == n for x, n in zip(lines, [8, 4, 2]))
    assert lines[0]["rounds"] == [2, 2, 2, 2]
    assert merges.records == lines
    assert run_summary["merge/stage"] == 3


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="mode"):
        UnlearningReplay(mode="exact")
    with pytest.raises(ValueError, match="sample"):
        UnlearningReplay(sample=0)
    with pytest.raises(ValueError, match="eps0"):
        UnlearningReplay(eps0=0.0)
    with pytest.raises(ValueError, match="alphas"):
        UnlearningReplay(alphas=[0.1, float("nan")])
    with pytest.raises(ValueError, match="alphas"):
        UnlearningReplay(alphas=[4.0])
    with pytest.raises(ValueError, match="alphas"):
        UnlearningReplay(alphas=["a"])


def test_given_alphas_are_used_instead_of_a_probe(run_root):
    """The alphas of another method's model (compare's shared reference) decide M_e, M_p and the table."""
    from fedshard_lightning.metrics import efficiency_fairness

    k = 6
    given = [(-1) ** c * (0.1 + 0.2 * c) for c in range(k)]
    shared = UnlearningReplay(mode="measured", mia=False, plots=False, alphas=given)
    trainer, model, dm = _make(run_root, k, [shared])
    trainer.fit(model, dm)
    assert shared.alphas_used.tolist() == given
    assert [r["alpha"] for r in shared.rows] == given
    costs = torch.tensor([float(r["Z_steps"]) for r in shared.rows], dtype=torch.float64)
    want = efficiency_fairness(costs, torch.tensor(given, dtype=torch.float64), shared.eps_alpha)
    assert shared.summary["M_e_steps"] == pytest.approx(float(want), rel=1e-12)
    short = UnlearningReplay(mode="predicted", mia=False, plots=False, alphas=given[:-1])
    trainer, model, dm = _make(run_root, k, [short])
    with pytest.raises(ValueError, match="5 values for 6 clients"):
        trainer.fit(model, dm)
