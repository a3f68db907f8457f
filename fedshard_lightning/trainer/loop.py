"""The trainer's side of the loop events: callbacks, per-round metrics and the commit after each stage.

:class:`TrainerEvents` is the :class:`~fedshard_lightning.unlearning.context.LoopEvents` that
the trainer hands an algorithm during ``fit``. It measures every round (sample-weighted train
loss; test accuracy of the sample-weighted average of the groups' models), fires the callbacks
with ``Fabric.call``, and commits FLCache at every ``stage_end`` and ``checkpoint``, whatever the
algorithm.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor

from fedshard_lightning.callbacks.dispatch import call_hook
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, RoundInfo
from fedshard_lightning.engine.allocator import configure_process
from fedshard_lightning.engine.optim import state_kept
from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.flcache.io import atomic_write_bytes, atomic_write_json, read_json_object
from fedshard_lightning.launch.exits import one_line as _one_line
from fedshard_lightning.launch.peer_watch import launch_watched
from fedshard_lightning.loggers.run_loggers import finish_loggers
from fedshard_lightning.loggers.wandb_segments import close_wandb_run
from fedshard_lightning.run import numerics
from fedshard_lightning.run.checkpoint import resolved_config, stale_files
from fedshard_lightning.run.directory import Journal, recover_reports
from fedshard_lightning.run.request_history import check_history
from fedshard_lightning.trainer.requests import validate_exclude
from fedshard_lightning.trainer.stage_loop import StageLoop
from fedshard_lightning.unlearning.context import AlgorithmContext, LoopEvents
from fedshard_lightning.unlearning.contract import check_params
from fedshard_lightning.unlearning.planner import Planner

__all__ = [
    "TrainerEvents",
    "all_gather",
    "check_same_seed",
    "reproduce_numerics",
    "run_fit",
    "sample_weighted_average",
]


def sample_weighted_average(
    state: dict[str, Tensor], groups: Sequence[Sequence[int]], sizes: Sequence[int]
) -> dict[str, Tensor]:
    """Average of stacked group models ``[G, ...]``, each weighted by its clients' training samples.

    Per-round and per-stage test accuracy both use it, so the two curves describe the same model.
    """
    if len(groups) == 1:  # weight exactly 1.0: the same bits without the arithmetic
        return {k: v[0] for k, v in state.items()}
    w = torch.tensor([float(sum(sizes[c] for c in g)) for g in groups], dtype=torch.float64)
    w = w / w.sum()
    return {k: (v * w.to(v).view(-1, *[1] * (v.ndim - 1))).sum(0) for k, v in state.items()}


def all_gather(fabric: L.Fabric) -> Callable[[Tensor], Tensor]:
    """Fabric's ``all_gather`` without torch's deprecation warning for the function it calls.

    Lightning 2.6 gathers with ``torch.distributed.nn.functional.all_gather``, deprecated in torch
    2.13: every rank printed the warning at each place that gathers (6 lines in a 2-process fit),
    about code the user cannot change.
    """

    def gather(tensor: Tensor) -> Tensor:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated"
            )
            return fabric.all_gather(tensor)

    return gather


class TrainerEvents(LoopEvents):
    """Loop events of one trainer call (``fit``); see the module docstring."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.global_round = 0
        self.client_steps = 0

    def context(self) -> AlgorithmContext:
        """What the algorithm sees of this trainer's run: engines, client sizes, seed, device, these events."""
        t = self.trainer

        def make_engine(schedule: LocalSchedule, client_fraction: float) -> FederatedEngine:
            engine = FederatedEngine(
                t.module,
                t.datamodule,
                schedule,
                seed=t.seed,
                client_fraction=client_fraction,
                vectorize=t.vectorize,
                max_chunk_clients=t.max_chunk_clients,
                memory_budget_mb=t.memory_budget_mb,
                batch_invariant=t.batch_invariant,
                compile=t.compile,
                gradient_clip_val=t.gradient_clip_val,
                gradient_clip_algorithm=t.gradient_clip_algorithm,
                optimizer_state=t.optimizer_state,
            )
            engine.on_mode = t._print
            engine.on_probe = t._print
            return engine

        return AlgorithmContext(
            make_engine=make_engine,
            client_sizes=t.client_sizes,
            seed=t.seed,
            device=t.device,
            events=self,
            world_size=t.fabric.world_size,
            global_rank=t.fabric.global_rank,
            all_gather=all_gather(t.fabric),
        )

    def stage_start(self, stage: int, groups: Sequence[Group]) -> None:
        """Fire ``on_stage_start``."""
        call_hook(self.trainer.fabric, "on_stage_start", self.trainer.view(), stage=stage, groups=groups)

    def stage_merge(self, stage: int, groups: Any, alphas: Any, rounds: Any) -> None:
        """Fire ``on_stage_merge``."""
        t = self.trainer
        call_hook(
            t.fabric, "on_stage_merge", t.view(), stage=stage, groups=groups, alphas=alphas, rounds=rounds
        )

    def round_end(self, info: RoundInfo, state: dict[str, Tensor], groups: Sequence[Group]) -> None:
        """Measure the round, then fire ``on_round_end``."""
        t = self.trainer
        self.client_steps += info.client_steps
        sizes = t.client_sizes
        active_w = [sum(sizes[c] for c in p) for p in info.participants]
        train_loss = sum(w * loss for w, loss in zip(active_w, info.mean_loss)) / max(sum(active_w), 1)
        metrics: dict[str, float] = {
            "stage": float(info.stage),
            "round": float(info.round),
            "train_loss": float(train_loss),
            "participants": float(sum(len(p) for p in info.participants)),
            "client_steps": float(self.client_steps),
            "round_seconds": info.seconds,
        }
        self.global_round += 1
        if t.eval_every_n_rounds and self.global_round % t.eval_every_n_rounds == 0:
            avg = sample_weighted_average(state, [g.clients for g in groups], sizes)
            acc, loss = t.evaluate(avg)
            metrics.update(test_accuracy=acc, test_loss=loss)
        for name, value in info.metrics.items():  # what training_step logged (engine names win)
            metrics.setdefault(name, value)
        metrics["global_round"] = float(self.global_round)
        t.history.append(metrics)
        call_hook(t.fabric, "on_round_end", t.view(), info=info, metrics=metrics)

    def stage_end(self, stage: int, metrics: dict[str, float] | None = None) -> None:
        """Commit the stage (rank zero), wait for every rank, then fire ``on_stage_end``."""
        self.checkpoint(f"stage-{stage}")
        call_hook(
            self.trainer.fabric, "on_stage_end", self.trainer.view(), stage=stage, metrics=metrics or {}
        )

    def groups_trained(self, stage: int, groups: Sequence[Group], client_steps: int) -> None:
        """Fire ``on_groups_trained`` (progress of unlearn and audit)."""
        t = self.trainer
        call_hook(
            t.fabric, "on_groups_trained", t.view(), stage=stage, groups=groups, client_steps=client_steps
        )

    def checkpoint(self, label: str, complete: bool | None = None) -> None:
        """Commit the algorithm's state now (complete: as the algorithm says, unless told)."""
        t = self.trainer
        complete = t.algorithm.is_complete() if complete is None else complete
        version = t.store.commit(t.algorithm, label, complete, t.algorithm.engine.mode)
        if version is not None:  # the writing process
            call_hook(t.fabric, "on_commit", t.view(), version=version, label=label)
        # At the first commit: a fit killed later is resumed in the environment it started in.
        if t.is_global_zero and t.run_dir is not None and not (t.run_dir / numerics.FILE).exists():
            numerics.record(t.run_dir, numerics.current(t.algorithm, t.module, t.device, t.tf32))
        t.fabric.barrier()

    def evaluate(self, params: dict[str, Tensor]) -> tuple[float, float]:
        """The trainer's test-set evaluation."""
        return self.trainer.evaluate(params)


def run_fit(trainer: Any, run_dir: Path, resume: bool, exclude: list[int]) -> dict[str, Any]:
    """``fit`` after setup: resume or reset the state, train, commit what no stage committed, write files.

    A resumed run continues from the restored state (``Algorithm.resumable``); any other fit
    resets the state first, so a reused algorithm instance trains like a fresh one. When the
    algorithm reported no final ``stage_end``, the finished state is committed here.
    """
    config = run_dir / "config.yaml"
    # new_run_dir wrote the CLI's config before any data was read; once the data has resolved the
    # model's shapes, the run records them (a resumed run's own config stays as it is)
    if (
        trainer.config_yaml is not None
        and trainer.is_global_zero
        and (not config.exists() or config.read_text() == trainer.config_yaml)
    ):
        resolved = resolved_config(trainer.config_yaml, trainer.module)
        if not config.exists() or resolved != trainer.config_yaml:
            atomic_write_bytes(config, resolved.encode())
    t0 = time.perf_counter()
    alg, resumed, finished = trainer.algorithm, False, False
    if resume and trainer.store.cache.exists():
        manifest = trainer.store.restore(alg, trainer.device, trainer.vectorize)
        # A CURRENT rolled back past a request would otherwise resume as a run never unlearned; the
        # stages to come would extend a broken manifest chain without a word.
        trainer.store.cache.history()
        check_history(run_dir, trainer.store.cache, manifest)
        if trainer.store.requests:
            raise CacheError(
                f"{trainer.store.cache.root}: this run has unlearning requests already; it cannot be resumed"
            )
        resumed = alg.resumable(manifest)
        finished = resumed and bool(manifest.get("complete"))
        if resumed:  # the stages to come must round like the committed ones (threads, ...)
            reproduce_numerics(trainer, run_dir)
    # W&B too when its segment takes the others' place (wandb_resume)
    replay = trainer.reporter.open_resumed_fit(run_dir, resumed, finished)
    if resumed and trainer.fabric.loggers and trainer.is_global_zero:
        events = trainer._events
        trainer.log_step_start, events.global_round, events.client_steps = trainer.reporter.restore_rows(
            replay
        )
    if not resumed:
        alg.reset(alg.engine.module_params(), exclude=validate_exclude(exclude, alg.num_clients))
        trainer.store.requests, trainer.store.complete_committed = [], False
    kept = state_kept(alg.engine.spec)
    if (
        kept and trainer.optimizer_state == "reset"
    ):  # never silently: a user of Adam may expect its moments kept
        trainer._print(
            f"note: the client optimizer {alg.engine.spec.cls.__name__} keeps state ({', '.join(kept)}); each "
            "client starts every round with a fresh optimizer, so that state is reset every round "
            "(trainer.optimizer_state keep carries it between rounds)"
        )
    call_hook(trainer.fabric, "on_fit_start", trainer.view())
    try:
        if finished:
            params = check_params(alg, alg.current_params(), "current_params")
        elif isinstance(alg, Planner):  # the trainer runs a planner's loop
            params = StageLoop(alg, trainer._events).fit()
        else:
            params = check_params(alg, alg.fit(), "fit")
    except BaseException:
        for logger in trainer.fabric.loggers:  # rows are written in batches: keep the stopped fit's
            with contextlib.suppress(OSError):
                logger.save()
        close_wandb_run(trainer.wandb)  # its segment is complete: a resume in this process writes a new one
        raise
    if not trainer.store.complete_committed:  # the algorithm reported no final stage: commit it here
        trainer._events.checkpoint("fit", complete=True)  # fit returned: the state is final
    seconds = time.perf_counter() - t0
    acc, loss = trainer.evaluate(params)
    metrics = {
        "test_accuracy": acc,
        "test_loss": loss,
        "client_steps": int(alg.total_client_steps),
        "seconds": seconds,
        "algorithm": alg.name,
        "num_clients": len(trainer.client_sizes),
        "vectorize_mode": alg.engine.mode,
        "resumed": resumed,
    }
    recorded = read_json_object(run_dir / "metrics.json") if finished else None
    if recorded is not None:  # a complete run resumed: nothing trained, so fit's own record stands
        trainer._print(f"fit: {run_dir} was already complete; nothing was trained (its metrics.json stands)")
        metrics = recorded
    if trainer.is_global_zero:
        if recorded is None or stale_files(run_dir, params, trainer.device, trainer.save_ckpt):
            trainer._write_model(params)
        if recorded is None:
            atomic_write_json(run_dir / "metrics.json", metrics)
        if read_json_object(run_dir / numerics.FILE) is None:  # recorded at the first commit
            numerics.record(run_dir, numerics.current(alg, trainer.module, trainer.device, trainer.tf32))
        for name, text in alg.run_files().items():
            (run_dir / name).write_text(text)
    call_hook(trainer.fabric, "on_fit_end", trainer.view(), metrics=metrics)
    if trainer.checkpoint_callback is None:  # enable_checkpointing false: the final model only
        freed = trainer.store.drop_cache(alg)
        trainer._print(
            f"kept only the final model (trainer.enable_checkpointing false): removed the FLCache "
            f"({freed / 2**20:.1f} MiB); unlearn and audit need it"
        )
        trainer.fabric.barrier()
    finish_loggers(
        trainer.fabric.loggers, trainer.wandb, run_dir, trainer.log_step_start + len(trainer.history) + 1
    )
    total = time.perf_counter() - t0  # with the callbacks' work at the end (replay, plots) and logging
    trainer._print(
        f"fit done: test_accuracy={acc:.4f} test_loss={loss:.4f} client_steps={metrics.get('client_steps')} "
        f"seconds={seconds:.1f} (total {total:.1f} with callbacks and logging) -> {run_dir}"
    )
    return metrics


def launch_fabric(
    accelerator: str,
    devices: int | str,
    strategy: str,
    precision: str,
    num_threads: int | None = None,
    tf32: bool | None = None,
    warn: bool = True,
) -> L.Fabric:
    """Create and launch Fabric (with ``strategy: ddp`` this starts the other processes).

    Then the process-wide settings, once: the allocator, the intra-op thread count, and a one-line
    warning on rank zero when the processes' threads oversubscribe the CPU (``warn``: a fit; the
    other commands take fit's count and check it then, :func:`reproduce_numerics`).
    """
    try:
        fabric = L.Fabric(accelerator=accelerator, devices=devices, strategy=strategy, precision=precision)
    except (ValueError, TypeError, RuntimeError, ImportError, MisconfigurationException) as e:
        # ImportError: an accelerator whose package is missing (tpu needs torch_xla)
        raise ConfigError(
            f"trainer.accelerator={accelerator!r}, trainer.devices={devices!r}, "
            f"trainer.strategy={strategy!r}, trainer.precision={precision!r}: {e}"
        ) from None
    try:
        launch_watched(fabric)  # fabric.launch(), a stopped worker stopping this process cleanly
    except TypeError as e:  # ddp_spawn/ddp_fork/ddp_notebook start a function, not the command again
        raise ConfigError(
            f"trainer.strategy={strategy!r}: the trainer's commands run in processes that re-run the "
            f"command line; use trainer.strategy ddp ({_one_line(str(e))})"
        ) from None
    configure_process(fabric.device, tf32)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if warn and fabric.is_global_zero and fabric.device.type == "cpu":
        warning = numerics.oversubscription_warning(torch.get_num_threads() * fabric.world_size)
        if warning:
            sys.stderr.write(warning + "\n")
    return fabric


def check_same_seed(fabric: L.Fabric, seed: int) -> None:
    """Refuse processes of one DDP run that were given different seeds, on every rank alike.

    Rank r trains its groups from its own seed while rank zero commits and records its own, so
    the model would equal no one-process fit and fail its audit (a launcher that draws
    ``seed_everything: true`` in each process, or a script that seeds each rank differently).
    """
    seeds = all_gather(fabric)(torch.tensor([seed], dtype=torch.long, device=fabric.device))
    seeds = [int(s) for s in seeds.flatten().tolist()]
    if len(set(seeds)) > 1:
        raise ConfigError(
            f"seed_everything: the {len(seeds)} processes of this DDP run have different seeds {seeds}; "
            "give every process the same one (--seed_everything N)"
        )


def reproduce_numerics(trainer: Any, run_dir: Path) -> None:
    """Take fit's numerical environment, print its notes, and warn if fit's threads now oversubscribe the CPU.

    The launch checked the threads the processes had then; fit's count (:func:`numerics.reproduce`)
    comes later, in every process. A one-process fit with 2 threads resumed by 2 processes on 2
    cores ran 4 threads unwarned: its last 3 stages took 186 s, the whole 2-process fit 17 s.
    """
    before = torch.get_num_threads()
    reproduced = numerics.reproduce(run_dir, trainer.algorithm, trainer.module, trainer.device, trainer.tf32)
    if reproduced.compile is not None:  # engines made from now on compile as fit's did
        trainer.compile = reproduced.compile
    if reproduced.tf32_changed:
        trainer.tf32 = reproduced.tf32
    trainer.numerics_notes = reproduced.notes
    for note in trainer.numerics_notes:
        trainer._print(f"warning: numerics: {note}")
    threads, world = torch.get_num_threads(), trainer.fabric.world_size
    # A resumed fit's launch checked these threads already; test, unlearn and audit launch unchecked.
    checked_at_launch = getattr(trainer, "_command", None) == "fit" and threads == before
    if not checked_at_launch and trainer.device.type == "cpu":
        crowded = numerics.oversubscription_warning(threads * world)
        if crowded and trainer.is_global_zero:
            sys.stderr.write(
                f"{crowded.split('; try')[0]} ({threads} thread(s), fit's count, kept for the same bits, in each of "
                f"{world} process(es)); run it with fewer processes (--trainer.devices) or on a quieter machine\n"
            )


def load_run(trainer: Any, run_dir: Path, command: str) -> None:
    """After setup: restore a finished run's state (fingerprint checked), then repair what a crash left.

    The cache is the truth: ``model.safetensors`` is rewritten when it differs from the cache's
    current model, and reports or journal lines of committed requests are re-created.
    """
    trainer.store.refuse_final_only(command)
    if not trainer.store.cache.exists():
        current = trainer.store.cache.root / "CURRENT"
        if current.exists() or current.is_symlink():  # there, but not a regular file
            raise CacheError(
                f"{current} is not a regular file: the run directory is damaged; restore it from a backup"
            )
        raise CacheError(
            f"{run_dir} has no committed FLCache (cache/CURRENT); was fit interrupted before stage 1?"
        )
    manifest = trainer.store.restore(trainer.algorithm, trainer.device, trainer.vectorize)
    trainer.store.cache.history()  # every older manifest there and unchanged: unlearn builds on the chain
    check_history(run_dir, trainer.store.cache, manifest)  # before the model file is written from it
    reproduce_numerics(trainer, run_dir)
    if not manifest.get("complete"):
        raise CacheError(
            f"{trainer.store.cache.root}: {trainer.algorithm.progress()}; "
            "resume it with fit --ckpt_path RUN_DIR first"
        )
    if not trainer.is_global_zero:
        return
    # The cache is the truth: re-create what a crash after a commit may have left stale.
    params = trainer.algorithm.current_params()
    stale = stale_files(run_dir, params, trainer.device, trainer.save_ckpt)
    if stale:
        trainer._write_model(params)  # never silently: a reader learns that the file had drifted
        trainer._print(
            f"note: {' and '.join(str(run_dir / n) for n in stale)} differed from the cache or was missing "
            "(or was a symbolic link); rewrote it from the cache"
        )
    else:
        trainer._set_params(params)
    recover_reports(run_dir, trainer.store.cache, trainer.store.requests, Journal(run_dir))
