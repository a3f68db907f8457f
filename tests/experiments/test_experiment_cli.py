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


@pytest.mark.parametrize("name", ["compare", "cascade", "poisoning"])
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
