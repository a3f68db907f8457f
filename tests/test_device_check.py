"""``benchmarks/device_check.sh`` says which steps failed and exits non-zero (its log was read by eye).

The interpreter is replaced by ``true`` or ``false`` so that every step passes or fails at once;
the script's own control flow is what is checked, not the GPU work.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.sh"
STEPS = [
    "cuda tests",
    "engine vs loop, chunk budget 16384 MB",
    "IEEE float32 (trainer.tf32 false) at K=256",
    "stacked convolutions by route, IEEE and TF32",
    "utilisation",
    "FedShard stage 1 of configs/cifar100.yaml (synthetic CIFAR-100 shape)",
]


def _run(python: str, log: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), str(log)],
        env={"PATH": "/usr/bin:/bin", "PYTHON": shutil.which(python) or python},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_failed_step_is_named_and_the_exit_is_1(tmp_path):
    done = _run("false", tmp_path / "check.log")
    assert done.returncode == 1
    log = (tmp_path / "check.log").read_text()
    assert log == done.stdout
    failed = [line.removeprefix("FAILED: ") for line in log.splitlines() if line.startswith("FAILED: ")]
    assert failed == [f"{step} (exit 1)" for step in STEPS]
    assert "every step passed" not in log


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_clean_run_says_so_and_exits_0(tmp_path):
    done = _run("true", tmp_path / "check.log")
    assert done.returncode == 0, done.stdout
    assert done.stdout.rstrip().endswith("every step passed")
    assert "FAILED" not in done.stdout
