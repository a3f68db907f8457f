"""The side-by-side comparison writes the Table-2 analogue for every method."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.experiments.compare import COLUMNS, compare
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedAvg, FedShard

FS = "fedshard (rounds: fixed)"  # a row that is not the paper's FedShard says which variant it runs


def _setting():
    data = SyntheticDataModule(
        num_clients=8, partition="iid", num_samples=96, num_test=40, shape=(6,), num_classes_=3
    )
    return MLP(hidden=(8,), lr=0.1), data


def test_compare_two_methods_two_seeds_equal_budget(tmp_path, capsys):
    model, data = _setting()
    res = compare(
        output_dir=str(tmp_path),
        algorithms=[FedShard(rounds="fixed", fixed_rounds=1, batch_size=5), FedAvg(rounds=2, batch_size=5)],
        model=model,
        data=data,
        clients=[1, 6],
        seeds=[0, 1],
        mia=False,
    )
    assert [(r["method"], r["seed"]) for r in res["rows"]] == [
        (FS, 0),
        ("fedavg", 0),
        (FS, 1),
        ("fedavg", 1),
    ]
    rows = list(csv.DictReader((tmp_path / "compare.csv").read_text().splitlines()))
    assert [r["method"] for r in rows] == [FS, "fedavg", FS, "fedavg"]
    for r in res["rows"]:
        assert r["client_steps"] > 0 and r["t"] >= 0 and r["M_p"] is not None
        assert r["M_e_steps"] is not None and r["M_e_seconds"] is not None and r["M_e_latency"] is not None
        assert r["clients_in_M_e_steps"] == 8  # every client, not only the 2 measured ones
    # SPEC section 4: methods side by side share one reference; every replay used the same alphas.
    for seed in (0, 1):
        tables = [
            list(csv.DictReader((Path(r["run_dir"]) / "fairness" / "clients.csv").read_text().splitlines()))
            for r in res["rows"]
            if r["seed"] == seed
        ]
        assert [row["alpha"] for row in tables[0]] == [row["alpha"] for row in tables[1]]
    fedshard, fedavg = res["rows"][:2]
    # equal budget: FedAvg's rounds are FedShard's fit client-steps over one round of all clients
    per_round = 8 * 3  # 8 clients, 12 samples, batch 5 -> 3 steps each
    assert fedavg["rounds"] == round(fedshard["fit_client_steps"] / per_round)
    assert abs(fedavg["fit_client_steps"] - fedshard["fit_client_steps"]) <= per_round / 2
    assert fedshard["client_steps"] < fedavg["client_steps"]  # retraining only the affected shards
    assert fedavg["speedup_steps"] == 1.0 and fedshard["speedup_steps"] > 1.0
    # mean +- std over the two seeds, units in the headers
    summary = {e["method"]: e for e in res["summary"]}
    vals = [r["fit_client_steps"] for r in res["rows"] if r["method"] == "fedavg"]
    assert summary["fedavg"]["fit_client_steps"]["mean"] == pytest.approx(sum(vals) / 2)
    assert summary["fedavg"]["fit_client_steps"]["n"] == 2
    md = (tmp_path / "compare.md").read_text()
    assert all(h in md for _, h, _ in COLUMNS) and "[1, 6]" in md and " ± " in md
    assert "M_e (client-steps^2 / rad)" in md and "M_e (s^2 / rad)" in md
    assert "M_e latency (steps^2 / rad)" in md
    assert r"\pm" in (tmp_path / "compare.tex").read_text()
    assert (tmp_path / "cost_distribution.png").stat().st_size > 0
    assert json.loads((tmp_path / "compare.json").read_text())["clients"] == [1, 6]
    # Off a terminal, one progress line per method and seed, with an ETA.
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("compare: ")]
    pattern = r"compare: method (\d)/4 (\w+(?: \([^)]*\))?) \(seed (\d)\) done · test_accuracy [\d.]+ · \d+ client-steps · .* · ETA (\S+)"
    found = [re.fullmatch(pattern, x) for x in lines]
    assert len(lines) == 4 and all(found), lines
    assert [(m.group(1), m.group(2), m.group(3)) for m in found] == [
        ("1", FS, "0"),
        ("2", "fedavg", "0"),
        ("3", FS, "1"),
        ("4", "fedavg", "1"),
    ]
    assert found[-1].group(4) == "0s"


def test_compare_labels_the_paper_row_and_a_variant_row(tmp_path):
    """FedShard as the paper specifies it and a variant stand side by side, each row labelled."""
    model, data = _setting()
    res = compare(
        output_dir=str(tmp_path),
        algorithms=[
            FedShard(max_rounds=2, batch_size=5),
            FedShard(rounds="stage_a2", max_rounds=2, batch_size=5),
            FedAvg(rounds=2, batch_size=5),
        ],
        model=model,
        data=data,
        clients=[3],
        mia=False,
    )
    assert [r["method"] for r in res["rows"]] == ["fedshard", "fedshard (rounds: stage_a2)", "fedavg"]
    md = (tmp_path / "compare.md").read_text()
    assert "fedshard (rounds: stage_a2)" in md
    with pytest.raises(ConfigError, match=r"each method .* may appear once"):
        compare(output_dir=str(tmp_path / "x"), algorithms=[FedShard(), FedShard()], model=model, data=data)


def test_compare_refuses_unequal_local_training(tmp_path):
    model, data = _setting()
    with pytest.raises(ConfigError, match="local_epochs=2"):
        compare(
            output_dir=str(tmp_path),
            algorithms=[FedShard(batch_size=5), FedAvg(rounds=1, batch_size=5, local_epochs=2)],
            model=model,
            data=data,
        )


def test_match_budget_rules():
    from fedshard_lightning.experiments.budget import match_budget
    from fedshard_lightning.unlearning import FATS, RapidRetrain

    steps = [2] * 10  # S = 20 client-steps per round of all clients
    fa, how = match_budget(FedAvg(rounds=3), 400, steps)
    assert fa.rounds == 20 and how["rounds"] == 20
    fats, _ = match_budget(FATS(rounds=3, sample_size=5), 400, steps)
    share = 1 - 0.9**5  # distinct share of 5 draws out of 10
    assert fats.rounds == round(400 / (20 * share))
    rr, how = match_budget(RapidRetrain(rounds=10, unlearn_rounds=5), 400, steps)
    assert rr.rounds == 20 and rr.unlearn_rounds == 10 and "unlearn_rounds" in how["rule"]
    _fs, how = match_budget(FedShard(rounds="fixed"), 400, steps)
    assert how["rounds"] is None
    capped, how = match_budget(FedShard(), 400, steps)  # calibrated: P = 4 stages for K = 10
    assert capped.round_policy.max_rounds == how["rounds"] == 400 // (4 * 20)


def test_compare_rejects_unknown_clients(tmp_path):
    model, data = _setting()
    with pytest.raises(ConfigError, match="unknown client ids"):
        compare(output_dir=str(tmp_path), algorithms=[FedAvg(rounds=1)], model=model, data=data, clients=[99])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"clients": [99]}, "clients"),
        ({"num_leaving": 0}, "num_leaving"),
        ({"vectorize": "x"}, "vectorize"),
        ({"eps_alpha": -1.0}, "eps_alpha"),
    ],
)
def test_refused_arguments_leave_no_output_folder(tmp_path, kwargs, field):
    model, data = _setting()
    out = tmp_path / "compare"
    with pytest.raises(ConfigError, match=rf"^{field}"):
        compare(output_dir=str(out), algorithms=[FedAvg(rounds=1)], model=model, data=data, **kwargs)
    assert not out.exists()


def test_compare_config_parses(capsys):
    from pathlib import Path

    from fedshard_lightning.experiments.compare import main

    config = Path(__file__).resolve().parents[2] / "configs" / "compare" / "digits.yaml"
    with pytest.raises(SystemExit) as e:
        main(["--config", str(config), "--print_config"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("FedShard", "FedAvg", "FATS", "FedEraser", "RapidRetrain", "FedRecover"):
        assert f"fedshard_lightning.unlearning.{name}" in out


@pytest.mark.parametrize("name", ["synthetic.yaml", "mia_synthetic.yaml", "mia_memorise.yaml"])
def test_other_compare_configs_parse(name, capsys):
    from pathlib import Path

    from fedshard_lightning.experiments.compare import main

    config = Path(__file__).resolve().parents[2] / "configs" / "compare" / name
    with pytest.raises(SystemExit) as e:
        main(["--config", str(config), "--print_config"])
    assert e.value.code == 0
    assert "seeds:" in capsys.readouterr().out


def test_poisoning_config_parses(capsys):
    from pathlib import Path

    from fedshard_lightning.experiments.poisoning import main

    config = Path(__file__).resolve().parents[2] / "configs" / "poisoning" / "approximate.yaml"
    with pytest.raises(SystemExit) as e:
        main(["--config", str(config), "--print_config"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("FedShard", "FedAvg", "FedEraser", "RapidRetrain", "FedRecover"):
        assert f"fedshard_lightning.unlearning.{name}" in out


def _tiny_compare(tmp_path, fedavg_rounds: int, **kw):
    """FedShard (1 round) against FedAvg on the tiny setting, client 1 unlearned, no MIA."""
    model, data = _setting()
    algorithms = [
        FedShard(rounds="fixed", fixed_rounds=1, batch_size=5),
        FedAvg(rounds=fedavg_rounds, batch_size=5),
    ]
    return compare(
        output_dir=str(tmp_path), algorithms=algorithms, model=model, data=data, clients=[1], mia=False, **kw
    )


def test_match_budget_records_the_matched_rounds(tmp_path):
    """The copy's recorded settings (cache fingerprint, hparams) are the rounds it trains.

    Reference: a run reopened from its recorded settings must retrain as many rounds as the fit
    trained. Before, the copy kept the template's ``rounds``: a compare run trained for 6 rounds
    recorded 3, refused ``rounds=6`` and, reopened with 3, unlearned by retraining 3 rounds.
    """
    from fedshard_lightning.experiments.budget import match_budget
    from fedshard_lightning.init_args import init_args
    from fedshard_lightning.unlearning import FATS, FedEraser, FedRecover, RapidRetrain

    steps = [2] * 10
    for template in (
        FedAvg(rounds=3),
        FATS(rounds=3, sample_size=5),
        FedEraser(rounds=3, delta_t=2, calibration_ratio=1.0),  # no "saves nothing" warning
        FedRecover(rounds=3, warmup_rounds=1),
        RapidRetrain(rounds=10, unlearn_rounds=5),
        RapidRetrain(rounds=10),
    ):
        alg, how = match_budget(template, 400, steps)
        recorded = init_args(alg)["init_args"]
        assert recorded["rounds"] == alg.rounds == how["rounds"] != template.rounds
        assert type(alg).__name__ == type(template).__name__
        if isinstance(alg, RapidRetrain):
            assert recorded["unlearn_rounds"] == alg.unlearn_rounds == 10
        assert init_args(template)["init_args"]["rounds"] == template.rounds  # the template is unchanged

    res = _tiny_compare(tmp_path, fedavg_rounds=1)
    fedavg = res["rows"][1]
    assert fedavg["rounds"] > 1
    model, data = _setting()
    from fedshard_lightning.trainer import FederatedTrainer

    tr = FederatedTrainer(
        algorithm=FedAvg(rounds=fedavg["rounds"], batch_size=5),
        default_root_dir=str(tmp_path / "re"),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
    )
    out = tr.unlearn(model, data, fedavg["run_dir"], [1])  # the run's true settings are accepted
    assert out["client_steps"] == fedavg["client_steps"]  # and retrain what compare's replay retrained


def test_wandb_table_has_the_spread_over_seeds(tmp_path):
    # The W&B table had only the means under the bare headers: with 2 seeds it read like one run.
    res = _tiny_compare(tmp_path, fedavg_rounds=2, seeds=[0, 1], wandb=True)
    tables = list((tmp_path / "wandb").rglob("compare_*.table.json"))
    assert len(tables) == 1, tables
    table = json.loads(tables[0].read_text())
    cols = table["columns"]
    assert cols[:2] == ["method", "seeds"]
    by_method = {row[0]: dict(zip(cols, row)) for row in table["data"]}
    for key, header, _ in COLUMNS:
        for method in (FS, "fedavg"):
            rows = [r for r in res["rows"] if r["method"] == method]
            vals = [float(r[key]) for r in rows if r[key] is not None]
            if not vals:
                continue
            mean = sum(vals) / len(vals)
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
            got = by_method[method]
            assert got["seeds"] == 2
            assert got[f"{header}, mean"] == pytest.approx(mean, rel=1e-9, abs=1e-12)
            assert got[f"{header}, sample std"] == pytest.approx(std, rel=1e-6, abs=1e-12)


def test_wandb_compare_run_joins_the_group_of_its_method_runs(tmp_path):
    """The table's W&B run is in the method runs' group, named after it, with the seeds and run ids.

    Reference: the group and ids read from the method runs' own offline W&B files. Before, every
    comparison was an ungrouped run named ``compare`` with an empty config.
    """
    from callbacks.test_replay import _wandb_records

    def run_records(path):
        first = next(r.run for r in _wandb_records(path) if r.WhichOneof("record_type") == "run")
        config = {i.key: json.loads(i.value_json) for i in first.config.update}
        return first, {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}

    _tiny_compare(tmp_path, fedavg_rounds=1, seeds=[0, 1], wandb=True)
    methods = [
        run_records(p)[0] for p in (tmp_path / "runs").glob("*/wandb_files/wandb/offline-run-*/run-*.wandb")
    ]
    assert len(methods) == 4
    (group,) = {r.run_group for r in methods}
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    run, config = run_records(path)
    assert (run.run_group, run.display_name) == (group, f"compare-{group}")
    assert config["seeds"] == [0, 1] and config["methods"] == [FS, "fedavg"]
    assert sorted(config["runs"]) == sorted(r.run_id for r in methods)


@pytest.mark.parametrize("experiment", ["compare", "cascade", "poisoning"])
def test_experiments_take_a_plain_lightning_module_by_class_path(experiment, tmp_path, monkeypatch, capsys):
    """The README's "your own model" is a plain LightningModule; the experiments had typed FederatedModule."""
    import importlib

    main = importlib.import_module(f"fedshard_lightning.experiments.{experiment}").main
    with pytest.raises(SystemExit) as e:  # tests/ is on sys.path, as a user's package would be
        main(["--model", "_models.Plain", "--model.inputs", "6", "--print_config"])
    assert e.value.code == 0
    assert "class_path: _models.Plain" in capsys.readouterr().out


def test_compare_runs_a_plain_lightning_module(tmp_path, monkeypatch):
    from _models import Plain

    _, data = _setting()
    res = compare(
        output_dir=str(tmp_path / "out"),
        algorithms=[FedShard(rounds="fixed", fixed_rounds=1, batch_size=5), FedAvg(rounds=1, batch_size=5)],
        model=Plain(inputs=6, classes=3),
        data=data,
        clients=[1],
        mia=False,
    )
    assert [r["method"] for r in res["rows"]] == [FS, "fedavg"]
    assert all(r["fit_client_steps"] > 0 for r in res["rows"])


def test_compare_draws_a_plain_modules_weights_from_the_seed(tmp_path, monkeypatch):
    """A plain LightningModule is built when the config is read, before any seed: compare had
    started every invocation from other weights (the same config gave 0.82 and 0.86), and every
    seed from the same. Reference: the module constructed under ``torch.manual_seed(seed)``, as
    ``fit --seed_everything seed`` constructs it."""
    import torch
    from _models import Plain

    from fedshard_lightning.flcache import FLCache

    _, data = _setting()
    theta0 = []
    for i, state in enumerate([100, 200]):
        torch.manual_seed(state)  # whatever the process drew before the config was read
        res = compare(
            output_dir=str(tmp_path / f"out{i}"),
            algorithms=[FedAvg(rounds=1, batch_size=5)],
            model=Plain(inputs=6, classes=3),
            data=data,
            seeds=[0, 1],
            clients=[1],
            mia=False,
        )
        theta0.append(
            [FLCache(Path(r["run_dir"]) / "cache").tensors("theta0.safetensors") for r in res["rows"]]
        )
    for seed in (0, 1):
        torch.manual_seed(seed)
        reference = Plain(inputs=6, classes=3).state_dict()
        for run in theta0:
            assert all(torch.equal(run[seed][k], reference[k]) for k in reference)
    assert not torch.equal(theta0[0][0]["net.0.weight"], theta0[0][1]["net.0.weight"])
