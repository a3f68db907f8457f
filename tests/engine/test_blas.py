"""MKL's reproducible mode: a client's batched matrix products are the same bits beside any neighbour.

The reference is plain: each client's product computed again as row 1 of a two-client call beside
another client, against its row in the full call. Each count runs in a fresh process, since MKL's
mode is process-wide and the engine sets it when imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

_COUNT = r"""
import json, random, sys
import torch
import fedshard_lightning.engine  # sets the mode, as every engine user does
from fedshard_lightning.engine.blas import blas_mode
result = {"mode": blas_mode()}
for threads in [int(t) for t in sys.argv[2].split(",") if t]:
  torch.set_num_threads(threads)
  random.seed(0)
  torch.manual_seed(0)
  bad = total = 0
  for _ in range(80):
      m, k, n, K = random.randint(1, 70), random.randint(1, 70), random.randint(1, 70), random.randint(2, 9)
      kind = random.choice(["bmm", "bmm_t", "baddbmm"])
      g = torch.randn(K, k, m)
      a = g.transpose(1, 2) if kind == "bmm_t" else torch.randn(K, m, k)
      b, w = torch.randn(K, k, n), torch.randn(K, m, n)
      f = (lambda a, b, w: torch.baddbmm(w, a, b, alpha=-0.1)) if kind == "baddbmm" else (lambda a, b, w: torch.bmm(a, b))
      full = f(a, b, w)
      for c in range(K):
          pair = [(c + 1) % K, c]
          a2 = g[pair].clone().transpose(1, 2) if kind == "bmm_t" else a[pair].clone()
          total += 1
          bad += not torch.equal(f(a2, b[pair].clone(), w[pair].clone())[1], full[c])
  result[threads] = {"bad": bad, "total": total}
print(json.dumps(result))
"""


def _count(threads: str, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _COUNT, "engine", threads],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | env,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")


@pytest.mark.exactness
@needs_mkl
def test_engine_import_makes_batched_products_neighbour_invariant():
    got = _count("1,2", {})
    assert got["mode"] == "AUTO"
    for threads in ("1", "2"):
        assert got[threads]["total"] > 300
        assert got[threads]["bad"] == 0, got


@pytest.mark.slow  # a fresh interpreter per thread count; the invariance test above runs by default
@needs_mkl
def test_a_mode_the_user_set_is_kept():
    # (empty would keep MKL's default dispatch; some CPUs, AVX2 without AVX-512, then round by position)
    assert _count("", {"MKL_CBWR": "COMPATIBLE"})["mode"] == "COMPATIBLE"


def test_this_process_runs_in_the_reproducible_mode():
    from fedshard_lightning.engine.blas import blas_mode

    if not torch.backends.mkl.is_available():
        assert blas_mode() == "none"
    elif "MKL_CBWR" not in os.environ or os.environ["MKL_CBWR"] == "AUTO":
        assert blas_mode() == "AUTO"
