"""The numerical environment of a run: what must match for float32 results to be the same bits.

The engine makes a client's arithmetic independent of who shares its computation
(docs/unlearning.md), but not of the machine: the device, the torch build, the thread count (MKL
and oneDNN split reductions by thread), the kernel family and the fixed-shape block size change
float32 rounding, as does the local-training path (stacked or loop), and so does TF32 on CUDA (``trainer.tf32``). ``fit`` records them in
``RUN/numerics.json``; ``unlearn``, ``audit`` and a resumed ``fit`` reproduce the thread count, ``trainer.compile`` and the TF32 switch,
warn in one line each about what they cannot reproduce, and ``audit`` names a mismatch as the
likely cause when it fails.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from fedshard_lightning.engine.allocator import configure_process, tf32_flags
from fedshard_lightning.engine.blas import blas_mode
from fedshard_lightning.flcache.io import atomic_write_json, read_json_object
from fedshard_lightning.unlearning.base import Algorithm

__all__ = [
    "FILE",
    "Reproduced",
    "current",
    "keep_caller_state",
    "oversubscription_warning",
    "record",
    "reproduce",
]

FILE = "numerics.json"
_F = TypeVar("_F", bound=Callable[..., Any])


def keep_caller_state(method: _F) -> _F:
    """Run a trainer call with the run's thread count, then give the caller back its own torch state.

    A call seeds torch's generator (lazy layers are built from ``trainer.seed``) and sets the
    thread count (``trainer.num_threads``, or fit's count for unlearn and audit). Both are the
    run's business: a notebook's later ``torch.rand`` or matrix product must see the stream and
    the threads it had before the call. CUDA generators are forked only when CUDA is already
    initialised, so a CPU call never starts CUDA.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=cuda):
                if self.num_threads is not None:  # applied at launch too: a trainer launches once
                    torch.set_num_threads(self.num_threads)
                return method(self, *args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return wrapper  # type: ignore[return-value]


def current(
    algorithm: Algorithm, module: nn.Module, device: torch.device, tf32: bool | None
) -> dict[str, Any]:
    """This process's environment for ``algorithm``'s engine and ``module`` on ``device`` (``tf32``: the trainer's switch)."""
    eng = algorithm.engine
    env: dict[str, Any] = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "blas_mode": blas_mode(),  # MKL's CNR mode: its default dispatch is not batch-invariant
        "dtype": str(next(module.parameters()).dtype),
        "engine_mode": eng.mode,
        "batch_invariant": eng.batch_invariant,
        "compile": eng.local.compiled,
        # (convolutions, matmuls) in TF32; a CPU has none
        "tf32": list(tf32_flags(tf32)) if device.type == "cuda" else [False, False],
    }
    if eng.mode == "stacked":
        env["kernel"] = str(eng.local.kernel_choice) if eng.local.kernel_choice else None
        env["invariant_block"] = eng.invariant_block()
    return env


def record(run_dir: Path, env: dict[str, Any]) -> dict[str, Any]:
    """Write the environment ``fit`` ran in (:func:`current`, atomically); returns it."""
    atomic_write_json(run_dir / FILE, env)
    return env


@dataclass(frozen=True)
class Reproduced:
    """What :func:`reproduce` did and found.

    Attributes:
        notes: One line per field that still differs from fit's.
        compile: Fit's ``trainer.compile`` when this process had another one (now applied to every
            engine of the algorithm), else ``None``.
        tf32_changed: Whether fit's ``trainer.tf32`` differed from this process's (it is now
            applied to the device).
        tf32: Fit's ``trainer.tf32`` when ``tf32_changed``.
    """

    notes: list[str] = field(default_factory=list)
    compile: bool | None = None
    tf32_changed: bool = False
    tf32: bool | None = None


def reproduce(
    run_dir: Path, algorithm: Algorithm, module: nn.Module, device: torch.device, tf32: bool | None
) -> Reproduced:
    """Match the recorded thread count, compile and TF32 settings; notes of every field that still differs.

    The thread count and the engines' compile switch are applied here, and TF32 to the device;
    the caller keeps fit's ``compile`` and ``tf32`` (:class:`Reproduced`) as its own settings.
    A run from before this file existed has nothing recorded; nothing is compared then.
    """
    path = run_dir / FILE
    if not path.is_file():
        return Reproduced()
    fit_env = read_json_object(path)
    if fit_env is None:
        return Reproduced([f"{path} is unreadable: the numerical environment of fit is unknown"])
    notes = []
    threads = fit_env.get("threads")
    if isinstance(threads, int) and threads > 0 and threads != torch.get_num_threads():
        notes.append(
            f"threads: fit used {threads}, this process had {torch.get_num_threads()}; using {threads}"
        )
        torch.set_num_threads(threads)
    fit_compile, eng = fit_env.get("compile"), algorithm.engine
    compiled: bool | None = None
    if isinstance(fit_compile, bool) and fit_compile != eng.local.compiled:
        # the compiled step rounds differently in float32 (1.8e-7 on digits): use fit's, like threads
        notes.append(
            f"compile: fit ran with {fit_compile}, this process had {eng.local.compiled}; "
            f"using fit's (trainer.compile: {json.dumps(fit_compile)})"
        )
        compiled = fit_compile
        for other in vars(algorithm).values():
            if isinstance(other, type(eng)):  # every engine made so far (FedEraser has two)
                other.local.compiled = fit_compile
    fit_tf32 = fit_env.get("tf32")
    tf32_changed = False
    if device.type == "cuda" and fit_tf32 in ([True, False], [True, True], [False, False]):
        now_tf32 = list(tf32_flags(tf32))
        if fit_tf32 != now_tf32:
            setting = {(True, False): None, (True, True): True, (False, False): False}[tuple(fit_tf32)]
            notes.append(
                f"tf32 (convolutions, matmuls): fit ran with {fit_tf32}, this process had {now_tf32}; "
                f"using fit's (trainer.tf32: {json.dumps(setting)})"
            )
            tf32, tf32_changed = setting, True
            configure_process(device, setting)
    now = current(algorithm, module, device, tf32)
    for key in (
        "engine_mode",
        "device",
        "device_name",
        "torch",
        "blas_mode",
        "dtype",
        "batch_invariant",
        "compile",
        "kernel",
        "invariant_block",
    ):
        # None: not decided yet in this process (the kernel is chosen at the first stacked call)
        if key in fit_env and now.get(key) is not None and fit_env[key] != now[key]:
            hint = (
                " (trainer.vectorize; the two paths agree to rounding, not bit for bit)"
                if key == "engine_mode"
                else ""
            )
            notes.append(f"{key}: fit ran with {fit_env[key]!r}, this process has {now[key]!r}{hint}")
    return Reproduced(notes, compiled, tf32_changed, tf32)


def oversubscription_warning(threads: int, load: float | None = None, cores: int | None = None) -> str | None:
    """One line when this run's threads plus the machine's load exceed its cores, else None.

    OpenMP threads that wait for busy cores spin: two threads under contention ran a CIFAR round
    6x slower than one thread (141 s against 22.7 s), so the user should hear about it. Only a
    load of more than one extra core counts: the 1-minute average keeps about 0.6 from the
    user's own previous command for a minute, which warned after every run on a quiet machine.
    """
    cores = cores or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    if threads <= 1 or load + threads <= cores + 1.0:
        return None
    return (
        f"warning: {threads} CPU threads on {cores} cores already loaded {load:.1f}: oversubscribed, "
        "which can be several times slower; try --trainer.num_threads 1"
    )
