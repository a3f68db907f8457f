"""The experiments' command lines: bad input is one ``error: ...`` line naming the field, exit 2."""

from __future__ import annotations

import pytest

from fedshard_lightning.experiments import cascade as cascade_module
from fedshard_lightning.experiments import compare as compare_module
from fedshard_lightning.experiments import poisoning as poisoning_module


def _one_error_line(capsys, main, args: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("module", "args", "field"),
    [
        (cascade_module, ["--initial_leavers", "100"], "initial_leavers"),
        (cascade_module, ["--max_iterations", "-1"], "max_iterations"),
        (poisoning_module, ["--num_clients", "1"], "num_clients"),
        (
            compare_module,
            [
                "--algorithms",
                '[{"class_path": "fedshard_lightning.unlearning.FedAvg", "init_args": {"rounds": 0}}]',
            ],
            "algorithm.rounds",
        ),
    ],
)
def test_config_errors_are_one_line(tmp_path, capsys, module, args, field):
    # Rejected before any training: the default Digits setting is only partitioned.
    err = _one_error_line(capsys, module.main, ["--output_dir", str(tmp_path), *args])
    assert field in err


@pytest.mark.parametrize(
    ("module", "option"),
    [(cascade_module, "--y_star"), (poisoning_module, "--threshold"), (compare_module, "--eps_alpha")],
)
def test_parse_errors_are_one_line(tmp_path, capsys, module, option):
    err = _one_error_line(capsys, module.main, ["--output_dir", str(tmp_path), option, "abc"])
    assert err == f"error: {option[2:]}: expected a float, got abc"


# Each is a fresh interpreter; the name comes from run_cli, which all three share, so cascade's and
# poisoning's run -m slow and compare's covers run_cli under python -m.
@pytest.mark.parametrize(
    "name",
    [
        "compare",
        pytest.param("cascade", marks=pytest.mark.slow),
        pytest.param("poisoning", marks=pytest.mark.slow),
    ],
)
def test_help_names_the_command_as_it_is_run(name):
    """``usage: python -m fedshard_lightning.experiments.NAME``, as typed (argparse said NAME.py)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", f"fedshard_lightning.experiments.{name}", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith(f"usage: python -m fedshard_lightning.experiments.{name} ["), out[:200]


def test_compare_is_a_subcommand_of_the_main_cli_listed_in_its_help(tmp_path):
    from pathlib import Path

    from _cli import cli

    code, out, _ = cli(["--help"])
    assert code == 0 and "'compare --config FILE'" in " ".join(out.split())
    code, out, _ = cli(["compare", "--help"])
    assert code == 0 and out.startswith("usage: python -m fedshard_lightning compare ["), out[:200]
    config = str(Path(__file__).resolve().parents[2] / "configs" / "compare" / "digits.yaml")
    code, out, _ = cli(["compare", "--config", config, "--print_config"])
    assert code == 0
    for name in ("FedShard", "FedAvg", "FATS", "FedEraser", "RapidRetrain", "FedRecover"):
        assert f"fedshard_lightning.unlearning.{name}" in out
    code, _, err = cli(["compare", "--config", config, "--num_leaving", "abc"])
    assert code == 2 and err == "error: num_leaving: expected an int, got abc\n", err
    # The shipped config runs (two of its methods, one seed, 16 clients: same options as the module).
    two = (
        '[{"class_path": "fedshard_lightning.unlearning.FedShard", "init_args": {"rounds": "fixed", '
        '"fixed_rounds": 1, "batch_size": 10, "local_epochs": 2}}, {"class_path": '
        '"fedshard_lightning.unlearning.FedAvg", "init_args": {"rounds": 2, "batch_size": 10, "local_epochs": 2}}]'
    )
    args = ["--output_dir", str(tmp_path), "--seeds", "[0]", "--num_leaving", "2", "--mia", "false"]
    code, out, err = cli(
        ["compare", "--config", config, *args, "--data.num_clients", "16", "--algorithms", two]
    )
    assert code == 0, err
    assert (tmp_path / "compare.md").is_file() and "fedshard" in out and "fedavg" in out
