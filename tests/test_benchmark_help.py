"""Every benchmark script answers ``--help`` (argparse) without running: a typo'd flag gets a usage line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

_RUN_ALL = """
import contextlib, io, runpy, sys
bad = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        bad.append(f"{path}: returned without exiting")
    except SystemExit as e:
        if e.code not in (0, None) or "usage:" not in out.getvalue():
            bad.append(f"{path}: exit {e.code!r}, printed {out.getvalue()[:80]!r}")
    except Exception as e:
        bad.append(f"{path}: {type(e).__name__}: {e}")
print("\\n".join(bad))
"""


def test_every_benchmark_script_prints_its_usage():
    scripts = sorted(str(p) for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    assert len(scripts) >= 10
    out = subprocess.run(
        [sys.executable, "-c", _RUN_ALL, *scripts],
        capture_output=True,
        text=True,
        cwd=BENCHMARKS,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", out.stdout
