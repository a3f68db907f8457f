"""``vectorize: auto``: which local-training path a model runs on, and why, in one line.

The stacked path is not always faster (a model of many small layers on a CPU may run faster one
client at a time), and not always possible (random operators that ``vmap`` cannot key per client
make the stacked step raise :class:`~.step_context.RandomInStep`, layers ``vmap`` cannot batch
exactly raise :class:`~.step_context.NotVectorizable`). :func:`choose_path` answers
both before the first round, with the reason the trainer prints at start-up.

The answer depends on the model and the machine, not on the run, so it is kept per model
signature (:func:`path_signature`): in the process (a second fit of the same model does not time
again) and in ``$FEDSHARD_CACHE_DIR`` (default ``~/.cache/fedshard_lightning``; empty: off) as
``vectorize_auto.json``, so a later process reuses it too. Delete that file to time again.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine.groups import Group
from fedshard_lightning.engine.kernels.loop import ClientBatch, LocalResult
from fedshard_lightning.engine.local import LocalTrainer
from fedshard_lightning.engine.neighbours import PROBE_STEPS, first_steps, neighbour_dependence
from fedshard_lightning.engine.round_plan import RoundPlan
from fedshard_lightning.engine.step_context import NotVectorizable
from fedshard_lightning.errors import ConfigError

__all__ = [
    "agreed_signatures",
    "check_agreement",
    "choose_path",
    "decided_paths",
    "first_round_sample",
    "path_signature",
    "probe_budget",
    "time_paths",
]

# The probe's version: decisions kept on disk by a probe that did not compare the paths' losses
# and a client's bits alone and among others (neighbours.py), or that saw the fx kernel apply
# sigmoid-like activations over all clients at once (per_client_ops.py), are made again.
_PROBE = "probe 5 (losses and neighbours compared; per-client activations; bounded)"

# Decisions of this process: signature -> (path, reason).
_DECIDED: dict[str, tuple[str, str]] = {}
# ``vectorize: always``: signatures whose stacked clients this process found to agree with the loop.
_AGREED: set[str] = set()


def decided_paths() -> dict[str, tuple[str, str]]:
    """The decisions this process holds (tests clear it to time again)."""
    return _DECIDED


def agreed_signatures() -> set[str]:
    """The ``vectorize: always`` checks this process passed (tests clear it to check again)."""
    return _AGREED


def path_signature(local: LocalTrainer, batch: ClientBatch) -> str:
    """What the timing depends on: model class and shapes, data, batch, device, dtype, threads, chunk."""
    module = local.module
    shapes = ",".join(f"{n}:{tuple(v.shape)}" for n, v in module.named_parameters())
    p = next(module.parameters())
    return "|".join(
        [
            _PROBE,
            f"{type(module).__module__}.{type(module).__qualname__}",
            shapes,
            f"input {tuple(local.dm.input_shape)}",
            f"batch {local.schedule.batch_size}",
            f"device {p.device}",
            f"dtype {p.dtype}",
            f"chunk {min(len(batch.clients), 8)}",
            f"optimizer {local.spec.cls.__name__}",
            f"kernel {local.kernel} {local.conv_mode} compiled={local.compiled}",
            f"threads {torch.get_num_threads()}",
            f"neighbours {'probed' if local.neighbour_run is not None else 'free'}",
            f"torch {torch.__version__}",
            f"cpus {os.cpu_count()} {_cpu_model()}",
            *([f"clip {local.clip.algorithm} {local.clip.val}"] if local.clip is not None else []),
        ]
    )


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else the platform's), so another machine decides anew."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _store() -> Path | None:
    root = os.environ.get("FEDSHARD_CACHE_DIR")
    if root is None:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedshard_lightning")
    return Path(root) / "vectorize_auto.json" if root else None


def _read(path: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _persist(path: Path, key: str, signature: str, mode: str, reason: str) -> None:
    """Add one decision to the file (atomic replace; an unwritable cache is skipped, never an error)."""
    with contextlib.suppress(OSError):
        data = _read(path)
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        data[key] = {"mode": mode, "reason": reason, "signature": signature, "decided": when}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


def first_round_sample(
    init: dict[str, Tensor],
    groups: Sequence[Group],
    stage: int,
    participants: Callable[[int, Group, int], list[int]],
    sizes: np.ndarray,
    chunk: int,
) -> tuple[dict[str, Tensor], ClientBatch] | None:
    """Round 0's first chunk of a call: the start models and clients its first round would time.

    ``vectorize: auto`` decides on them before the engine picks its lean or general path, so both
    paths decide on the same models and clients.
    """
    active = [i for i, g in enumerate(groups) if g.rounds > 0 and g.clients]
    if not active:
        return None
    parts = [participants(stage, groups[i], 0) for i in active]
    first = next(iter(init.values()))
    plan = RoundPlan.build(active, parts, len(groups), sizes, chunk, first.dtype, first.device)
    ch = plan.chunks[0]
    start = {k: v.index_select(0, ch.owners_t) for k, v in init.items()}
    return start, ClientBatch(ch.clients, [groups[i].key for i in ch.owners], stage, 0)


def choose_path(
    local: LocalTrainer,
    start: dict[str, Tensor],
    batch: ClientBatch,
    say: Callable[[str], None] | None = None,
    work: int | None = None,
) -> tuple[str, str]:
    """``(path, reason)``: the decision kept for this model signature, else :func:`time_paths`.

    A decision that came from the cache says so (and where) in its reason. ``say`` and ``work``
    go to :func:`time_paths`.
    """
    signature = path_signature(local, batch)
    if signature in _DECIDED:
        mode, reason = _DECIDED[signature]
        return mode, f"{reason}; kept from an earlier fit of this model in this process"
    key, path, entry = _kept(signature, ("stacked", "loop"))
    if entry is not None:
        _DECIDED[signature] = (entry["mode"], str(entry.get("reason", "vectorize: auto")))
        return entry["mode"], f"{entry.get('reason')} ({entry.get('decided')}, kept in {path})"
    mode, reason = time_paths(local, start, batch, say, work)
    _DECIDED[signature] = (mode, reason)
    if path is not None:
        _persist(path, key, signature, mode, reason)
    return mode, reason


def check_agreement(local: LocalTrainer, start: dict[str, Tensor], batch: ClientBatch) -> None:
    """``vectorize: always``: refuse a model whose stacked clients train otherwise than the loop.

    ``always`` skips the timing, not the check: a ``training_step`` that vmap batches wrongly and
    no layer shows (a functional ``F.embedding(padding_idx=...)``) would otherwise train a wrong
    model in silence. :data:`.neighbours.PROBE_STEPS` local steps of a few clients both ways, once per model signature (in
    the process, and on disk beside ``auto``'s decisions); the fit's results are not touched.

    Raises:
        ConfigError: If the two paths' losses differ beyond rounding, or a client's bits depend
            on the clients beside it (:func:`.neighbours.neighbour_dependence`).
    """
    signature = f"always|{path_signature(local, batch)}"
    if signature in _AGREED:
        return
    key, path, entry = _kept(signature, ("agrees",))
    if entry is not None:
        _AGREED.add(signature)
        return
    try:
        off, tolerance = _compare(local, start, batch)
    except NotVectorizable:
        return  # the fit falls back to the loop itself, and says why
    if not off <= tolerance:
        raise ConfigError(
            f"trainer.vectorize=always: the stacked clients' losses differ from the per-client loop's by "
            f"{off:.1e} (relative) in {PROBE_STEPS} local steps, so training_step does something vmap does not "
            "batch exactly; set trainer.vectorize to auto or never"
        )
    dependent = neighbour_dependence(local, start, batch)
    if dependent is not None:
        raise ConfigError(
            f"trainer.vectorize=always: {dependent}: {_unexact(start)}; set trainer.vectorize to auto or never"
        )
    _AGREED.add(signature)
    if path is not None:
        _persist(path, key, signature, "agrees", f"vectorize: always; losses agree within {off:.1e}")


def _kept(signature: str, modes: tuple[str, ...]) -> tuple[str, Path | None, dict | None]:
    """``(key, file, entry)``: the decision kept on disk for ``signature`` if its mode is one of ``modes``."""
    key = hashlib.sha256(signature.encode()).hexdigest()[:24]
    path = _store()
    entry = _read(path).get(key) if path is not None else None
    ok = isinstance(entry, dict) and entry.get("signature") == signature and entry.get("mode") in modes
    return key, path, entry if ok else None


def _unexact(start: dict[str, Tensor]) -> str:
    """``float32 unlearning would not be bit-exact`` (with the run's dtype)."""
    dtype = str(next(iter(start.values())).dtype).removeprefix("torch.")
    return f"{dtype} unlearning would not be bit-exact"


def _sizes(batch: ClientBatch) -> dict[str, int]:
    """Clients each path runs in the probe: up to 8 stacked, 2 on the loop (linear in clients)."""
    k = min(len(batch.clients), 8)
    return {"stacked": k, "loop": min(k, 2)}


def _compare(local: LocalTrainer, start: dict[str, Tensor], batch: ClientBatch) -> tuple[float, float]:
    """``(disagreement, tolerance)`` of the two paths in a few local steps; raises ``NotVectorizable``."""
    warm = _probe_runs(local, start, batch, _sizes(batch))
    first = next(iter(start.values()))
    return disagreement(warm["stacked"], warm["loop"]), agreement_tolerance(first.dtype, first.device)


def _runs(
    local: LocalTrainer, batch: ClientBatch, sizes: dict[str, int]
) -> dict[str, tuple[Callable[..., LocalResult], ClientBatch]]:
    """Each path's training function and its first ``sizes[path]`` clients of ``batch``."""
    return {
        mode: (
            fn,
            ClientBatch(batch.clients[: sizes[mode]], batch.groups[: sizes[mode]], batch.stage, batch.round),
        )
        for mode, fn in (("stacked", local.train_stacked), ("loop", local.train_loop))
    }


def _probe_runs(
    local: LocalTrainer, start: dict[str, Tensor], batch: ClientBatch, sizes: dict[str, int]
) -> dict[str, LocalResult]:
    """The first local steps of each path's first clients (results apart from the fit's)."""
    with first_steps(local, PROBE_STEPS):
        return {
            mode: fn({n: v[: sizes[mode]] for n, v in start.items()}, sub)
            for mode, (fn, sub) in _runs(local, batch, sizes).items()
        }


def agreement_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """Relative disagreement of the two paths' probe losses above which ``auto`` keeps the loop.

    Exact models measured on the CPU (MLPs, CNNs with and without BatchNorm and dropout,
    ResNetGN, a scheduler) disagree by at most 1.9e-7 in float32; a functional
    ``F.embedding(padding_idx=...)``, which vmap batches wrongly, by 5.2e-5 in the probe's
    :data:`.neighbours.PROBE_STEPS` steps. TF32 and half precision round at 1e-3, so there only
    gross errors can be told from rounding.
    """
    if dtype == torch.float64:
        return 1e-9
    tf32 = device.type == "cuda" and (
        torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
    )
    return 1e-5 if dtype == torch.float32 and not tf32 else 1e-2


def disagreement(stacked: LocalResult, loop: LocalResult) -> float:
    """Largest relative difference of the per-client summed losses of the clients both paths ran.

    Losses, not parameters: a parameter without true gradient (a bias before BatchNorm) gets
    rounding noise that Adam scales up to a full step, differently on each path, but changes no
    loss; everything that does change the model's function shows in the second step's loss.
    Clients whose loss is not finite on both paths are left to training to report; a loss finite
    on one path only is a disagreement.
    """
    n = len(loop.loss_sum)
    a, b = stacked.loss_sum[:n].double(), loop.loss_sum.double()
    finite = b.isfinite()
    if not torch.equal(a.isfinite(), finite):
        return math.inf
    if not finite.any():  # the same clients diverged on both: training reports them, not the probe
        return 0.0
    a, b = a[finite], b[finite]
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


#: The probe's time bound: this many seconds, or :data:`BUDGET_SHARE` of the run it decides for.
BUDGET_S = 10.0
BUDGET_SHARE = 0.02


def probe_budget(work: int | None, loop_s_per_step: float) -> float:
    """Seconds the probe may take: ``max(BUDGET_S, BUDGET_SHARE x the call's predicted time)``.

    The prediction is the call's client-steps at a measured speed: the loop's while only the loop
    has run, then the faster path's (both first runs include one-time costs, so it errs long).
    """
    predicted = (work or 0) * loop_s_per_step
    return max(BUDGET_S, BUDGET_SHARE * predicted)


def _timed(
    fn: Callable[..., LocalResult], start: dict[str, Tensor], sub: ClientBatch
) -> tuple[LocalResult, float]:
    n = len(sub.clients)
    t = time.perf_counter()
    res = fn({k: v[:n] for k, v in start.items()}, sub)
    return res, time.perf_counter() - t


def time_paths(
    local: LocalTrainer,
    start: dict[str, Tensor],
    batch: ClientBatch,
    say: Callable[[str], None] | None = None,
    work: int | None = None,
) -> tuple[str, str]:
    """Time the first local steps per client both ways (results discarded); ``(cheaper path, reason)``.

    Bounded and visible: ``say`` gets a line as it starts and as each part ends. The loop runs
    first on 2 clients (its cost is linear in clients); its speed predicts the call and so the
    budget (:func:`probe_budget`), and how many clients (2 to 8) the stacked path can run within
    it (its cost per client falls with more clients, so fewer is conservative). Both first runs
    must agree (losses within rounding); they are timed too, kernel building included, and the
    faster one sets the budget anew. Further interleaved timings, whose best time per client
    counts (one preempted run on a busy machine does not decide), run only while the budget
    lasts, and each sets it anew at the best speed seen. Where the stacked path is the cheaper, a client's bits must not depend on its
    neighbours (:func:`.neighbours.neighbour_dependence`), else the loop trains it; these two
    first runs and that check are what exactness needs, so they run whatever the budget.

    Args:
        local: The engine's local trainer.
        start: Starting state of the batch's clients, one row per client.
        batch: The first chunk of the first round.
        say: Where the progress lines go (None: nowhere).
        work: Client-steps of the call the decision is for (for the budget), if known.
    """
    say = say or (lambda _line: None)
    t0 = time.perf_counter()
    full = _sizes(batch)
    say(
        f"vectorize: auto: timing the stacked path against the per-client loop ({PROBE_STEPS} local steps of up to "
        f"{full['stacked']} clients; once per model and machine)"
    )
    runs = _runs(local, batch, full)
    first: dict[str, LocalResult] = {}
    per_client: dict[str, float] = {}
    with first_steps(local, PROBE_STEPS):
        fn, sub = runs["loop"]
        first["loop"], spent = _timed(fn, start, sub)
        per_client["loop"] = spent / full["loop"]
        budget = probe_budget(work, per_client["loop"] / PROBE_STEPS)
        left = budget - (time.perf_counter() - t0)
        k = full["stacked"]
        if per_client["loop"] * k > left / 2:  # a slow model: fewer stacked clients (never below the loop's)
            k = max(full["loop"], min(k, int(left / 2 / max(per_client["loop"], 1e-9))))
        say(
            f"vectorize: auto: per-client loop {1e3 * per_client['loop']:.0f} ms/client; now the stacked path "
            f"on {k} clients (budget {budget:.0f}s)"
        )
        fn, _ = runs["stacked"]
        sub = ClientBatch(batch.clients[:k], batch.groups[:k], batch.stage, batch.round)
        try:
            first["stacked"], spent = _timed(fn, start, sub)
        except NotVectorizable as err:
            return "loop", f"vectorize: auto; {err}; {err.fallback}"
        per_client["stacked"] = spent / k
        off = disagreement(first["stacked"], first["loop"])
        first_dt = next(iter(start.values()))
        if not off <= agreement_tolerance(first_dt.dtype, first_dt.device):
            return "loop", (
                f"vectorize: auto; the stacked clients' losses differ from the per-client loop's by {off:.1e} "
                f"(relative) in {PROBE_STEPS} local steps: training_step does something vmap does not batch exactly"
            )
        runs["stacked"] = (fn, sub)
        budget = probe_budget(work, min(per_client.values()) / PROBE_STEPS)  # at the faster path's speed
        repeats = 0
        while repeats < 2:  # timings without kernel building, while the budget lasts
            one = sum(per_client[m] * len(runs[m][1].clients) for m in runs)
            if time.perf_counter() - t0 + one > budget:
                break
            repeats += 1
            for mode, (fn, sub) in runs.items():
                _, spent = _timed(fn, start, sub)
                per_client[mode] = min(per_client[mode], spent / len(sub.clients))
            # Without the first runs' one-time costs (kernel building, warm-up) the predicted call
            # is shorter, and so is the budget.
            budget = probe_budget(work, min(per_client.values()) / PROBE_STEPS)
    ms = {m: f"{1e3 * v:.2f}" for m, v in per_client.items()}
    took = time.perf_counter() - t0
    timed = f"{repeats + 1} timing(s) in {took:.1f}s"
    reason = (
        f"vectorize: auto; timed {ms['stacked']} ms/client stacked vs {ms['loop']} ms/client loop ({timed})"
    )
    mode = min(per_client, key=per_client.get)
    if mode == "stacked" and local.neighbour_run is not None:
        say(
            "vectorize: auto: the stacked path is faster; checking that a client's bits do not depend on its neighbours"
        )
        dependent = neighbour_dependence(local, start, batch)
        if dependent is not None:
            return "loop", f"vectorize: auto; {dependent}: {_unexact(start)}"
    say(f"vectorize: auto: done in {time.perf_counter() - t0:.1f}s (budget {budget:.0f}s)")
    return mode, reason
