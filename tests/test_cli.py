"""The command line: subcommands, configs, run directories and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedshard_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--data.num_clients",
    "8",
    "--trainer.algorithm.rounds",  # A2 in a hand-set range: short fits (the default, auto, trains to convergence)
    "a2",
    "--trainer.algorithm.t1",
    "2",
    "--trainer.algorithm.t0",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]


def _run(args, capsys):
    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "config",
    sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "configs").rglob("*.yaml")
        if p.parent.name not in ("compare", "poisoning")
    ),
)
def test_every_config_parses(config, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    base = (
        []
        if config == "configs/digits.yaml"
        or ("/" not in config.removeprefix("configs/") and not config.startswith("configs/fedavg"))
        else ["--config", "configs/digits.yaml"]
    )
    code, out, err = _run(["fit", *base, "--config", config, "--print_config"], capsys)
    assert code == 0, err
    assert "class_path" in out


def test_fit_test_unlearn_audit_end_to_end(run_root, capsys):
    code, out, err = _run(["fit", *TINY, "--trainer.default_root_dir", str(run_root)], capsys)
    assert code == 0, err
    run = run_root / "version_0"
    assert f"run directory: {run}" in out
    for name in (
        "model.safetensors",
        "config.yaml",
        "metrics.json",
        "tree.txt",
        "logs/metrics.csv",
        "cache/CURRENT",
    ):
        assert (run / name).is_file(), name
    metrics = json.loads((run / "metrics.json").read_text())
    assert {"test_accuracy", "test_loss", "client_steps", "seconds"} <= set(metrics)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["data"]["init_args"]["num_clients"] == 8

    code, _, _ = _run(["fit", *TINY, "--trainer.default_root_dir", str(run_root)], capsys)
    assert code == 0 and (run_root / "version_1").is_dir(), "a second fit gets a new folder"

    code, out, err = _run(["test", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)], capsys)
    assert code == 0, err
    assert f"test_accuracy={metrics['test_accuracy']:.4f}" in out

    code, out, err = _run(
        ["unlearn", "--config", str(run / "config.yaml"), "--ckpt_path", str(run), "--clients", "[3, 5]"],
        capsys,
    )
    assert code == 0, err
    report = json.loads((run / "unlearn_report.json").read_text())
    assert report["clients"] == [3, 5]
    for key in (
        "client_steps",
        "retrain_client_steps",
        "predicted_client_steps",
        "seconds",
        "test_accuracy_before",
        "test_accuracy_after",
        "retrained_shards",
    ):
        assert key in report
    assert report["predicted_client_steps"] == report["client_steps"]

    code, out, err = _run(["unlearn", "--ckpt_path", str(run), "--clients", "6"], capsys)  # one id alone
    assert code == 0, err
    assert json.loads((run / "unlearn_report.json").read_text())["clients"] == [6]

    code, out, err = _run(["audit", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)], capsys)
    assert code == 0, err
    assert "audit PASSED" in out
    assert "unlearned clients [3, 5, 6]" in out


def test_fit_without_config_uses_digits_defaults(capsys):
    code, out, _ = _run(["fit", "--print_config"], capsys)
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["data"]["class_path"].endswith("DigitsDataModule")
    assert cfg["trainer"]["algorithm"] is None or "FedShard" in str(cfg["trainer"]["algorithm"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["fit", "--trainer.no_such_key", "1"], "no_such_key"),
        (["fit", "--data.num_clients", "5000"], "num_clients"),
        (["fit", "--data.rho", "0"], "rho"),
        (["fit", "--data.rho", "-1"], "rho"),
        (["fit", "--trainer.algorithm.merge_rate", "1"], "merge_rate"),
        (["fit", "--trainer.algorithm.t0", "9", "--trainer.algorithm.t1", "3"], "t0"),
        (["fit", "--trainer.algorithm.batch_size", "0"], "batch_size"),
        (["fit", "--model", "_models.CumulativeBNMLP"], "momentum=None"),
        (["fit", "--model", "_models.PlateauMLP"], "ReduceLROnPlateau"),
        (["fit", "--model", "_models.LBFGSMLP"], "LBFGS"),
        (["unlearn", "--ckpt_path", "/nonexistent/run", "--clients", "[1]"], "ckpt_path"),
        (
            ["unlearn", "--ckpt_path", "/nonexistent/run", "--clients", "3.5"],
            "clients='3.5': give plain integers",
        ),
        (
            ["fit", "--trainer.max_chunk_clients", "x"],
            "trainer.max_chunk_clients: expected int or null, got x",
        ),
    ],
)
def test_one_line_errors(args, needle, capsys, run_root):
    code, _, err = _run(
        [*args, "--trainer.default_root_dir", str(run_root)] if args[0] == "fit" else args, capsys
    )
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in err


def test_ckpt_path_alone_loads_the_run_config(run_root, capsys):
    """unlearn/audit/test with --ckpt_path RUN read RUN/config.yaml; a flag still overrides it."""
    code, _, err = _run(
        ["fit", *TINY, "--data.rho", "0.3", "--trainer.default_root_dir", str(run_root)], capsys
    )
    assert code == 0, err
    run = run_root / "version_0"
    code, out, err = _run(["test", "--ckpt_path", str(run)], capsys)
    assert code == 0, err
    assert "test_accuracy=" in out
    code, out, err = _run(["unlearn", "--ckpt_path", str(run), "--clients", "[2]"], capsys)
    assert code == 0, err
    assert json.loads((run / "unlearn_report.json").read_text())["clients"] == [2]
    code, out, err = _run(["audit", "--ckpt_path", str(run)], capsys)
    assert code == 0, err
    assert "audit PASSED" in out
    # A flag after the run's config overrides it: another partition is refused by the fingerprint.
    code, _, err = _run(["audit", "--ckpt_path", str(run), "--data.num_clients", "9"], capsys)
    assert code == 2, err


def test_with_run_config_inserts_the_run_config_first(tmp_path):
    from fedshard_lightning.cli import with_run_config

    (tmp_path / "config.yaml").write_text("seed_everything: 0\n")
    args = ["unlearn", "--ckpt_path", str(tmp_path), "--clients", "[1]"]
    assert with_run_config(args) == ["unlearn", "--config", str(tmp_path / "config.yaml"), *args[1:]]
    assert with_run_config(["fit", "--data.rho", "1"]) == ["fit", "--data.rho", "1"]
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    assert with_run_config(["test", f"--ckpt_path={weights}"])[1:3] == [
        "--config",
        str(tmp_path / "config.yaml"),
    ]
    assert with_run_config(["audit", "--ckpt_path", str(tmp_path / "none")]) == [
        "audit",
        "--ckpt_path",
        str(tmp_path / "none"),
    ]


def test_cli_without_running_loads_a_config():
    """Lightning's way to load a config in Python: FederatedCLI(args=[...], run=False)."""
    from fedshard_lightning.cli import FederatedCLI

    cli = FederatedCLI(args=["--config", str(ROOT / "configs" / "digits.yaml")], run=False)
    assert cli.trainer.algorithm._init_args["local_epochs"] == 2
    assert "local_epochs: 2" in cli.trainer.config_yaml


def test_readme_python_api_matches_digits_config():
    """The README's Python snippet builds the objects of configs/digits.yaml."""
    from fedshard_lightning.cli import FederatedCLI

    text = (ROOT / "README.md").read_text()
    block = text.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(block.split("trainer = ", 1)[0], namespace)  # definitions only, nothing trains
    cli = FederatedCLI(args=["--config", str(ROOT / "configs" / "digits.yaml")], run=False)
    config = yaml.safe_load((ROOT / "configs" / "digits.yaml").read_text())
    pairs = [
        (namespace["algorithm"](), config["trainer"]["algorithm"]),
        (namespace["model"], config["model"]),
        (namespace["data"], config["data"]),
    ]
    for obj, entry in pairs:
        assert type(obj).__name__ == entry["class_path"].rsplit(".", 1)[-1]
        for key, value in entry["init_args"].items():
            assert obj._init_args[key] == value, (type(obj).__name__, key)
    assert cli.trainer.algorithm._init_args == namespace["algorithm"]()._init_args


def test_help_is_plain_text(capsys):
    code, out, _ = _run(["fit", "--help"], capsys)
    assert code == 0
    assert "``" not in out and ":class:" not in out and ":meth:" not in out
    assert "--ckpt_path RUN_DIR" in out


@pytest.mark.parametrize("args", [["--help"], ["cache", "--help"], ["runs", "--help"]])
def test_other_help_screens_are_plain_text(args, capsys):
    code, out, _ = _run(args, capsys)
    assert code == 0
    assert "``" not in out and ":meth:" not in out and ":class:" not in out


def test_top_level_help_names_every_command(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    for command in ("fit", "test", "unlearn", "audit", "runs", "cache"):
        assert command in out


@pytest.mark.parametrize(
    ("message", "want"),
    [
        (  # jsonargparse's dump for a Union, as it prints it
            'Parser key "clients":\n  Does not validate against any of the Union subtypes\n'
            "  Subtypes: [list[int], <class 'int'>]\n  Errors:\n    - Expected a <class 'list'>\n"
            "    - Expected a <class 'int'>\n  Given value type: <class 'str'>\n  Given value: 3.5",
            "clients: expected list[int] or int, got 3.5",
        ),
        (
            'Parser key "trainer":\n  Parser key "loggers":\n  Subtypes: [dict[str, int], <class \'NoneType\'>]\n'
            "  Errors:\n    - nope\n  Given value: q",
            "trainer.loggers: expected dict[str, int] or null, got q",
        ),
        (
            'Parser key "data":\n  Parser key "rho": Expected a <class \'float\'>. Got value: inf',
            "data.rho: expected a float, got inf; give a finite number",
        ),
    ],
)
def test_parse_reason_turns_jsonargparse_dumps_into_field_and_reason(message, want):
    from fedshard_lightning.cli import parse_reason

    assert parse_reason(message) == want


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["test"], "error: test: give --ckpt_path RUN_DIR (the folder that fit created); it is required"),
        (
            ["unlearn"],
            "error: unlearn: give --ckpt_path RUN_DIR (the folder that fit created) and --clients; "
            "they are required",
        ),
        (["audit"], "error: audit: give --ckpt_path RUN_DIR (the folder that fit created); it is required"),
    ],
)
def test_a_missing_required_argument_names_the_flag_and_what_to_give(args, want, capsys):
    code, _, err = _run(args, capsys)
    assert code == 2
    assert err.strip().splitlines() == [want]


def test_test_help_shows_ckpt_path_as_required(capsys):
    code, out, _ = _run(["test", "--help"], capsys)
    assert code == 0
    help_of = out.split("\n  --ckpt_path CKPT_PATH", 1)[1].split("\n  --", 1)[0]
    assert "required" in help_of and "default: null" not in help_of, help_of


def test_plain_text_removes_rst_roles():
    from fedshard_lightning.cli import plain_text

    assert plain_text("see :class:`~a.b.FederatedTrainer` and ``x``") == "see FederatedTrainer and x"
    assert plain_text(":meth:`a.b`") == "a.b"


def test_missing_optional_logger_names_the_real_cause(capsys, run_root, monkeypatch):
    from lightning.fabric.loggers import tensorboard as tb

    monkeypatch.setattr(tb, "_TENSORBOARD_AVAILABLE", False)  # as if neither package were installed
    monkeypatch.setattr(tb, "_TENSORBOARDX_AVAILABLE", False)
    code, _, err = _run(
        [
            "fit",
            "--trainer.loggers",
            "lightning.fabric.loggers.TensorBoardLogger",
            "--trainer.loggers.root_dir",
            str(run_root),
            "--trainer.default_root_dir",
            str(run_root),
        ],
        capsys,
    )
    assert code == 2
    assert "Neither `tensorboard` nor `tensorboardX` is available" in err, err
    assert "dict with parameters" not in err and len(err.strip().splitlines()[-1]) < 300, err


def test_missing_tensorboard_for_the_tensorboard_option_names_the_extra(capsys, run_root, monkeypatch):
    from lightning.fabric.loggers import tensorboard as tb

    monkeypatch.setattr(tb, "_TENSORBOARD_AVAILABLE", False)
    monkeypatch.setattr(tb, "_TENSORBOARDX_AVAILABLE", False)
    code, _, err = _run(
        ["fit", *TINY, "--trainer.tensorboard", "true", "--trainer.default_root_dir", str(run_root)], capsys
    )
    assert code == 2
    assert "error: trainer.tensorboard=true: the tensorboard package is not available;" in err, err
    assert "[tb]" in err and not list(run_root.iterdir())


# Lightning reads "16" and "bf16" as 16-mixed and bf16-mixed: they had trained float32 silently.
# transformer-engine had ended in a ModuleNotFoundError traceback.
@pytest.mark.parametrize("precision", ["16-mixed", "16", "bf16", "transformer-engine"])
def test_mixed_precision_is_refused_in_one_line(capsys, run_root, precision):
    code, _, err = _run(
        ["fit", "--trainer.precision", precision, "--trainer.default_root_dir", str(run_root)], capsys
    )
    assert code == 2
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("Seed set")]
    assert len(lines) == 1 and f"error: trainer.precision='{precision}'" in lines[0], err
    assert "use 32-true or 64-true" in lines[0]


def test_seed_everything_true_draws_and_records_a_seed(capsys, run_root):
    from fedshard_lightning.cli import FederatedCLI

    seeds = {FederatedCLI(args=["--seed_everything", "true"], run=False).trainer.seed for _ in range(3)}
    assert len(seeds) > 1 or 0 not in seeds
    cli = FederatedCLI(args=["--seed_everything", "true"], run=False)
    assert f"seed_everything: {cli.trainer.seed}" in cli.trainer.config_yaml


def test_interrupted_fit_prints_the_command_that_resumes_it(run_root, capsys):
    args = ["fit", *TINY, "--trainer.callbacks", "_callbacks.InterruptOnceAtStage"]
    code, out, err = _run([*args, "--trainer.default_root_dir", str(run_root)], capsys)
    run = run_root / "version_0"
    assert code == 130
    command = f"python -m fedshard_lightning fit --ckpt_path {run}"
    assert f"resume with: {command}" in err and err.rstrip().endswith("interrupted")
    code, out, err = _run(command.split()[3:], capsys)  # exactly that command, nothing added
    assert code == 0, err
    assert "fit done:" in out and json.loads((run / "metrics.json").read_text())["resumed"] is True


def test_num_threads_is_applied_and_oversubscription_warned():
    import torch

    from fedshard_lightning.run.numerics import oversubscription_warning
    from fedshard_lightning.trainer import FederatedTrainer

    before = torch.get_num_threads()
    trainer = FederatedTrainer(num_threads=1)
    trainer._launch()
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)
    assert oversubscription_warning(2, load=2.0, cores=2).startswith("warning: 2 CPU threads")
    assert "--trainer.num_threads 1" in oversubscription_warning(2, load=2.0, cores=2)
    assert oversubscription_warning(1, load=5.0, cores=2) is None
    assert oversubscription_warning(2, load=0.0, cores=2) is None
    assert oversubscription_warning(2, load=0.7, cores=2) is None  # the previous command's echo
    assert oversubscription_warning(2, load=1.3, cores=2) is not None  # another busy core
    with pytest.raises(Exception, match="num_threads"):
        FederatedTrainer(num_threads=0)


def test_plain_lightning_module_by_class_path(run_root, capsys):
    """A plain LightningModule (not FederatedModule) trains, says its path, logs its self.log values."""
    args = ["fit", *TINY, "--model", "_models.PlainMLP", "--model.num_classes", "10"]
    code, out, err = _run([*args, "--trainer.default_root_dir", str(run_root)], capsys)
    assert code == 0, err
    assert sum(line.startswith("local training: ") for line in out.splitlines()) >= 1
    header = (run_root / "version_0" / "logs" / "metrics.csv").read_text().splitlines()[0]
    assert "train_loss_logged" in header
    code, out, err = _run(
        [
            "audit",
            "--config",
            str(run_root / "version_0" / "config.yaml"),
            "--ckpt_path",
            str(run_root / "version_0"),
        ],
        capsys,
    )
    assert code == 0, err
    assert "audit PASSED" in out


@pytest.mark.parametrize("name", ["compare", "poisoning", "cascade"])
def test_experiment_help_is_plain_text(name, capsys):
    import importlib

    experiment = importlib.import_module(f"fedshard_lightning.experiments.{name}")
    with pytest.raises(SystemExit) as e:
        experiment.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--config" in out
    assert "``" not in out and ":class:" not in out and ":meth:" not in out


@pytest.mark.parametrize("delay", [1.0, 5.0])
def test_ctrl_c_answers_in_one_line_during_start_up_and_during_training(tmp_path, delay):
    """SIGINT while torch/Lightning import (once torch's library is loaded) or later: exit 130, no traceback."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedshard_lightning",
            "fit",
            "--config",
            "configs/digits.yaml",
            "--trainer.algorithm.rounds",
            "a2",
            "--trainer.algorithm.t1",
            "200",
            "--trainer.default_root_dir",
            str(tmp_path / "runs"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell that runs us in the background may ignore SIGINT; Python only maps it to
        # KeyboardInterrupt when it starts with the default action.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    maps = f"/proc/{proc.pid}/maps"
    if delay < 5 and os.path.exists(maps):
        # Wait until torch's library is loaded: the signal then lands inside our import of torch
        # and Lightning, not in the interpreter's own start-up (slow on a loaded machine).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError), open(maps) as f:
                if "libtorch" in f.read():
                    break
            time.sleep(0.02)
    else:
        time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and any(line.startswith("interrupted") for line in err.splitlines()), err


def test_sigterm_stops_a_fit_like_ctrl_c(tmp_path):
    """A batch system's cancel (SIGTERM): exit 143, one line, the resume command."""
    import os
    import signal
    import subprocess
    import sys
    import time

    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "fedshard_lightning", "fit", "--config", "configs/digits.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [
        "--trainer.algorithm.rounds",
        "a2",
        "--trainer.algorithm.t1",
        "200",
        "--trainer.default_root_dir",
        str(runs),
    ]
    proc = subprocess.Popen(
        [*command, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:  # until stage 1 is committed
        if list(runs.glob("*/cache/CURRENT")):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and err.rstrip().endswith("terminated (SIGTERM)"), err[-2000:]
    (run,) = runs.iterdir()
    assert f"--ckpt_path {run}" in err


def test_a_long_error_keeps_its_reason(tmp_path, capsys):
    """A very long run directory: the one line drops the path's middle, not the reason at its end."""
    deep = tmp_path / ("d" * 200) / ("e" * 200) / ("f" * 200)
    code, _, err = _run(["runs", "--root", str(deep)], capsys)
    line = err.strip().splitlines()[-1]
    assert code == 2 and len(line) <= 610 and " ... " in line
    assert line.endswith("(fit's trainer.default_root_dir, default runs)"), line


def test_failed_audit_exits_1_from_the_cli_only(run_root, capsys, monkeypatch):
    """README's exit status 1 for a failed audit; the Python call returns the verdict instead."""
    from fedshard_lightning.unlearning import FedShard

    code, _, err = _run(["fit", *TINY, "--trainer.default_root_dir", str(run_root)], capsys)
    assert code == 0, err
    run = run_root / "version_0"
    original = FedShard.audit_compare

    def tampered(self, state, reference, tolerance, steps):
        # a final model that differs from its replay, in memory only
        first = next(iter(state.models[-1]))
        state.models[-1][first][0] += 1e-3
        return original(self, state, reference, tolerance, steps)

    monkeypatch.setattr(FedShard, "audit_compare", tampered)
    code, out, err = _run(["audit", "--ckpt_path", str(run)], capsys)
    assert code == 1, err
    assert "audit FAILED" in out and "Traceback" not in err


def test_fedshard_with_one_client_is_refused_before_a_run_directory_is_named(capsys, run_root):
    args = ["fit", "--config", str(ROOT / "configs" / "digits.yaml"), "--data.num_clients", "1"]
    code, out, err = _run([*args, "--trainer.default_root_dir", str(run_root)], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == "error: data.num_clients=1: FedShard needs 2 or more clients", err
    assert "run directory" not in out, out  # no folder named that the refusal then removed
    assert not list(run_root.glob("version_*"))
