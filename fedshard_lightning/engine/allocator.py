"""Keep freed CPU memory in the process, so stacked training stops paying page faults.

Stacked clients make every step allocate and free tensors of a few MB (gradients, activations
of all clients at once). glibc's malloc serves such sizes with fresh ``mmap`` pages or trims the
heap after each free, so every step page-faults and zero-fills them again, and on small models
that work rivals the step's own arithmetic. Raising glibc's mmap
and trim thresholds keeps the freed memory for reuse; the resident set stays at its peak instead
of shrinking between steps. Set ``FEDSHARD_KEEP_MALLOC=1`` to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["configure_process", "retain_freed_memory", "tf32_flags"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done: bool | None = None


def retain_freed_memory(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where not glibc or disabled."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("FEDSHARD_KEEP_MALLOC") == "1":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (macOS, Windows, musl without mallopt)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) or mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    ok_trim = mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    _done = bool(ok_mmap and ok_trim)
    return _done


def tf32_flags(tf32: bool | None) -> tuple[bool, bool]:
    """(cuDNN convolutions, cuBLAS matmuls) in TF32 for ``trainer.tf32``; None is torch's default."""
    return (True, False) if tf32 is None else (bool(tf32), bool(tf32))


def configure_process(device: str | object, tf32: bool | None = None) -> None:
    """Process-wide settings for training on ``device``, applied once at start-up.

    The trainer calls this when it launches (benchmarks that build engines directly call it too);
    constructing an engine changes nothing outside itself. CUDA keeps its own caching allocator;
    there cuDNN is limited to deterministic algorithms, so that the same shapes give the same bits
    (exact unlearning), and does not benchmark algorithms per shape. TF32 is set explicitly
    (:func:`tf32_flags`), so a process's bits never depend on what ran in it before: ``None``
    keeps torch's defaults (convolutions TF32, matmuls IEEE), ``True`` TF32 in both, ``False``
    IEEE float32 in both (slower for convolutions and no more accurate than TF32 for the grouped
    ones; docs/gpu.md's H100 table has the IEEE rates).
    """
    kind = str(device).split(":")[0]
    if kind == "cpu":
        retain_freed_memory()
    elif kind == "cuda":
        import torch

        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # The legacy switches: torch._inductor (trainer.compile) still reads them, and mixing
        # them with the per-operator fp32_precision API raises.
        conv, matmul = tf32_flags(tf32)
        torch.backends.cudnn.allow_tf32 = conv
        torch.backends.cuda.matmul.allow_tf32 = matmul
