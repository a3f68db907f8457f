"""MKL in conditional numerical reproducibility (CNR) mode, so a client's bits never depend on its row.

The stacked kernels compute every client's matrix products in one batched call (``bmm``,
``baddbmm``). With MKL's default dispatch on a CPU with AVX2 and no AVX-512 (AMD EPYC, torch
2.13's MKL 2024.2), the float32 result of one matrix in such a call depends on where it sits in
the batch and on how many share the call: 99 of 2,147 client products of random shapes changed
their bits when the same client sat beside another neighbour (``tests/engine/test_blas.py``
measures it in a subprocess), so the engine's neighbour check refused the stacked path and float32
unlearning would not have been bit-exact. In MKL's CNR mode ``AUTO`` (MKL still picks the code
path for the CPU, but keeps it fixed for every call) the same count is 0, on 1 and 2 threads.

The mode is set once, when the engine is imported: through MKL's service call (which takes effect
even after torch has run a product) and ``MKL_CBWR`` in the environment, which DDP workers and any
other child process inherit. An ``MKL_CBWR`` the user set is respected, whatever its value (set
it empty to keep MKL's default dispatch); :func:`blas_mode` reports what is in force, and
``numerics.json`` records it so that ``unlearn`` and ``audit`` under another mode say so.
"""

from __future__ import annotations

import ctypes
import glob
import os

__all__ = ["blas_mode", "reproducible_blas", "set_blas_mode"]

# mkl_service.h: MKL_CBWR_BRANCH asks for the code branch; the values name it; STRICT is a flag.
_BRANCH = 1
_AUTO = 2
_STRICT = 0x10000
_NAMES = {
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1",
    15: "AVX512_E2",
}
_lib: ctypes.CDLL | bool | None = False  # False: not looked up yet; None: no MKL in this torch


def _mkl() -> ctypes.CDLL | None:
    """The library that holds torch's MKL service calls (statically linked into libtorch_cpu)."""
    global _lib
    if _lib is not False:
        return _lib  # type: ignore[return-value]
    _lib = None
    import torch

    if not torch.backends.mkl.is_available():
        return None
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "mkl_serv_cbwr_set") and hasattr(lib, "mkl_serv_cbwr_get"):
            lib.mkl_serv_cbwr_set.argtypes = [ctypes.c_int]
            lib.mkl_serv_cbwr_get.argtypes = [ctypes.c_int]
            _lib = lib
            break
    return _lib  # type: ignore[return-value]


def reproducible_blas() -> str:
    """Put MKL in CNR mode ``AUTO`` unless the user chose a mode; returns :func:`blas_mode`."""
    if "MKL_CBWR" not in os.environ:
        os.environ["MKL_CBWR"] = "AUTO"  # for child processes, before their MKL starts
        lib = _mkl()
        if lib is not None:
            lib.mkl_serv_cbwr_set(_AUTO)
    return blas_mode()


def blas_mode() -> str:
    """MKL's code branch in force (``AUTO``, ``OFF`` for its default dispatch...), or ``none``."""
    lib = _mkl()
    if lib is None:
        return "none"
    branch = lib.mkl_serv_cbwr_get(-1)  # MKL_CBWR_ALL: the branch with the STRICT flag
    name = _NAMES.get(branch & ~_STRICT, f"mode {branch & ~_STRICT}")
    return name + (",STRICT" if branch & _STRICT else "")


def set_blas_mode(name: str) -> str:
    """Switch MKL's branch in this process (``AUTO``, ``OFF``...): for measuring what the mode costs.

    Raises:
        ValueError: an unknown name, or no MKL in this torch.
    """
    codes = {v: k for k, v in _NAMES.items()}
    lib = _mkl()
    if lib is None or name not in codes:
        raise ValueError(
            f"cannot set MKL's mode to {name!r} (known: {', '.join(codes)}; MKL: {lib is not None})"
        )
    lib.mkl_serv_cbwr_set(codes[name])
    return blas_mode()
