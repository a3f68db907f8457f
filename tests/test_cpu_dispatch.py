"""The exactness tests again under the dispatch of a CPU with AVX2 and no AVX-512 (an AMD EPYC's).

MKL and ATen pick their kernels by the CPU, and on an AVX2-only CPU MKL's default dispatch made a
client's float32 bits depend on its row (``engine/blas.py``). A developer on an AVX-512 machine
reproduces that CPU with ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2``; this
test runs the ``exactness`` tests so, in a fresh process (both are read when the libraries start).
On a CPU that already dispatches AVX2 the main run is that run, and the test says so as it skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx2(), reason="no AVX2 on this CPU (or no /proc/cpuinfo): nothing to reproduce")
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "AVX2",
    reason="this CPU dispatches AVX2 already: the main run covers the exactness tests under it",
)
def test_exactness_tests_pass_under_an_avx2_only_dispatch():
    env = dict(os.environ, MKL_ENABLE_INSTRUCTIONS="AVX2", ATEN_CPU_CAPABILITY="avx2")
    env.pop("MKL_CBWR", None)  # as a user's shell has it: the engine sets its own mode
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "exactness", "tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    tail = "\n".join(out.stdout.splitlines()[-30:])
    assert out.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail
