"""``python -m fedshard_lightning``: a LightningCLI over :class:`FederatedTrainer`.

Subcommands are the trainer's methods (``fit``, ``test``, ``unlearn``, ``audit``), plus
``cache gc`` / ``cache verify`` (:mod:`fedshard_lightning.cli.cache_command`, no config needed) and
``compare`` (:mod:`fedshard_lightning.experiments.compare`); configs use
``class_path``/``init_args`` for the model, the data, the algorithm and callbacks. Every error a
user can cause is printed as one line, ``error: ...``, with exit status 2 and no traceback; an
environment fault (disk full, read-only, ``ulimit -f``, no permission) is one line too, with
exit status 3 to 7 (:mod:`fedshard_lightning.launch.os_faults`).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from fedshard_lightning.cli.config_code import TRUST_FLAG, check_run_config_code
from fedshard_lightning.cli.inputs import check_command_line, check_numbers, join_negative_values
from fedshard_lightning.cli.no_config import no_config_main
from fedshard_lightning.cli.yaml_bounds import check_yaml
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.errors import ConfigError, FedShardError
from fedshard_lightning.launch.exits import one_line as _one_line
from fedshard_lightning.launch.exits import one_line_errors
from fedshard_lightning.launch.os_faults import ignore_sigxfsz, terminate_as_interrupt
from fedshard_lightning.launch.parse_errors import PlainHelpParser, parse_reason, plain_text
from fedshard_lightning.trainer.trainer import FederatedTrainer

__all__ = ["FederatedCLI", "PlainHelpParser", "main", "parse_reason", "plain_text"]

# `runs`, `cache` and `compare` are dispatched before the CLI parser (they are not trainer
# methods), so its help names them.
_DESCRIPTION = (
    "FedShard federated (un)learning. Three more commands: "
    "'compare --config FILE' trains several methods at one budget and tabulates their unlearning "
    "costs and fairness (the paper's Table 2); "
    "'runs --root DIR' lists the runs under DIR; 'cache gc|verify --ckpt_path RUN' prunes or "
    "checks a run's FLCache (each has its own --help). A config is code: it imports what its "
    "class_path entries name. With --ckpt_path RUN the run's own config.yaml is read, and a class_path "
    "whose module is not from an installed package (or lies in the run folder) is refused unless "
    f"{TRUST_FLAG} is given."
)

DEFAULTS = {
    "model": {"class_path": "fedshard_lightning.models.MLP", "init_args": {"hidden": [64, 64]}},
    "data": {"class_path": "fedshard_lightning.data.DigitsDataModule"},
    "trainer.algorithm": {"class_path": "fedshard_lightning.unlearning.FedShard"},
}


_GENERIC = (
    "Expected a",
    "Problem with given class_path",
    "Not a valid subclass",
    "Subclass types expect",
    "a class path",
    "a dict ",
)


def _innermost_reason(message: str) -> str:
    """The most specific line of a jsonargparse Union error (the class's own message).

    jsonargparse lists what every Union member expected; the real cause (a validation error, or
    an import failure such as a missing optional package) is either a ``- `` line of its own or
    the indented line under ``Problem with given class_path``. Generic lines are skipped.
    """
    lines = message.splitlines()
    reasons = [
        line.strip()[2:]
        for line in lines
        if line.strip().startswith("- ") and not line.strip()[2:].startswith(_GENERIC)
    ]
    if reasons:
        return reasons[-1]
    for line, after in itertools.pairwise(lines):
        head = line.strip()
        if (
            head.startswith("- Problem with given class_path")
            and after.strip()
            and not after.strip().startswith("- ")
        ):
            where = head.removeprefix("- Problem with given class_path").strip().rstrip(":")
            return f"{where}: {after.strip()}"
    return message


def _check_config_files(argv: list[str]) -> None:
    """Name the file in errors about a malformed ``--config`` (jsonargparse does not)."""
    paths = [b for a, b in itertools.pairwise(argv) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for p in paths:
        if os.path.isfile(p):
            check_config_file(Path(p), f"--config {p}", "fix the file")


def check_config_file(path: Path, name: str, fix: str) -> dict[str, Any]:
    """Refuse a config file that is not UTF-8, not YAML, empty or not a mapping, in one line naming it.

    Returns its settings.
    """
    import yaml

    try:
        text = path.read_bytes().decode("utf-8")
        check_yaml(text, name, fix)  # before any expansion: aliases, depth, duplicate keys
        data = yaml.safe_load(text)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not UTF-8 text (byte {e.start}); {fix}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: not valid YAML ({_one_line(str(e), 200)}); {fix}") from None
    if data is None:
        raise ConfigError(f"{name}: the file is empty; {fix}")
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a mapping of settings, got {type(data).__name__}; {fix}")
    return data


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` (the last one), else None."""
    value = None
    for a, b in itertools.pairwise([*argv, ""]):
        if a == name:
            value = b
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def with_run_config(argv: list[str]) -> list[str]:
    """``test``/``unlearn``/``audit`` (and a resuming ``fit``) with ``--ckpt_path RUN`` read ``RUN/config.yaml``.

    The run's resolved config goes first, so any ``--config`` or flag the user gives still
    overrides it; a run without a config.yaml (Python API runs) is left as it is. A config is code:
    one naming a module from outside the installed packages is refused unless ``--trust_run_config``
    is given (:mod:`fedshard_lightning.cli.config_code`); that flag is taken off the command line here.
    """
    trusted = TRUST_FLAG in argv
    argv = [a for a in argv if a != TRUST_FLAG]
    if not argv or argv[0] not in ("fit", "test", "unlearn", "audit"):
        return argv
    ckpt = _option(argv, "--ckpt_path")
    if not ckpt:
        return argv
    run = Path(ckpt)
    config = (run.parent if run.is_file() else run) / "config.yaml"
    if not config.is_file():
        return argv
    data = check_config_file(
        config, str(config), "restore it from a backup, or delete it and pass the run's settings"
    )
    check_run_config_code(config, data, trusted)
    return [argv[0], "--config", str(config), *argv[1:], *_one_process(argv, config)]


def _one_process(argv: list[str], config: Path) -> list[str]:
    """Flags that keep ``test``/``unlearn``/``audit`` in one process when only the run's config asks for DDP.

    A DDP fit records ``devices: 2, strategy: ddp``; reading it back must not silently start two
    processes again (the engine is batch-invariant, so one process gives the same bits). Flags
    given on the command line still win.
    """
    import yaml

    if argv[0] == "fit" or _option(argv, "--trainer.devices") or _option(argv, "--trainer.strategy"):
        return []
    try:
        trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return []  # the config is read again (and refused in one line) by the parser
    devices, strategy = trainer.get("devices", 1), str(trainer.get("strategy", "auto"))
    if devices in (1, "1", "auto", None) and strategy in ("auto", "single_device"):
        return []
    sys.stderr.write(
        f"note: {config} asks for trainer.devices={devices}, trainer.strategy={strategy}; {argv[0]} runs in one "
        f"process (same bits); add --trainer.devices {devices} --trainer.strategy {strategy} to use them\n"
    )
    return ["--trainer.devices", "1", "--trainer.strategy", "auto"]


def launcher_seed() -> int | None:
    """The seed the launching process drew, in a DDP worker that Fabric's launcher started; else None.

    The launcher re-runs the command line in each worker, so ``seed_everything: true`` would draw
    again there and rank r would train its groups from another seed than the one rank zero records
    (the model then differs from any one-process fit and fails its audit). The launcher's
    ``seed_everything`` left its seed in ``PL_GLOBAL_SEED``, which the worker inherits.
    """
    if os.environ.get("LOCAL_RANK", "0") in ("", "0"):
        return None
    try:
        seed = int(os.environ.get("PL_GLOBAL_SEED", ""))
    except ValueError:
        return None
    return seed if 0 <= seed < 2**32 else None


class _Parser(PlainHelpParser, LightningArgumentParser):
    """Lightning's parser with the experiments' plain help and one-line parse errors."""


class FederatedCLI(LightningCLI):
    """LightningCLI whose trainer is a :class:`FederatedTrainer` (not a Lightning Trainer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", L.LightningModule)
        kwargs.setdefault("datamodule_class", FederatedDataModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("trainer_class", FederatedTrainer)
        kwargs.setdefault("save_config_callback", None)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("parser_class", _Parser)
        kwargs.setdefault("load_from_checkpoint_support", False)
        kwargs.setdefault(
            "parser_kwargs",
            {"prog": "python -m fedshard_lightning", "description": _DESCRIPTION},
        )
        if not args and kwargs.get("args") is None:
            argv = with_run_config(sys.argv[1:])
            if argv != sys.argv[1:]:  # passing args= beside a command line makes Lightning warn
                sys.argv[1:] = argv
        elif isinstance(kwargs.get("args"), list):
            kwargs["args"] = with_run_config([str(a) for a in kwargs["args"]])
        super().__init__(*args, **kwargs)

    def _parse_ckpt_path(self) -> None:
        """Do nothing: ckpt_path is a run directory or a .safetensors file, loaded by the trainer without pickle."""

    def _set_seed(self) -> None:
        """``seed_everything: true`` draws a fresh seed (recorded in config.yaml), then seeds as Lightning does.

        Lightning's own draw reuses ``PL_GLOBAL_SEED`` from an earlier seeding in the process.
        """
        seed = self._get(self.config, "seed_everything")
        if not isinstance(seed, bool) and isinstance(seed, int) and not 0 <= seed < 2**32:
            raise ConfigError(
                f"seed_everything={seed}: give an integer in [0, 2**32), or true for a fresh one"
            )
        if seed is True:
            drawn = launcher_seed()
            seed = random.SystemRandom().randrange(2**31) if drawn is None else drawn
            (self.config[self.subcommand] if self.subcommand else self.config)["seed_everything"] = seed
            if drawn is None:
                sys.stderr.write(f"seed_everything: true -> drew seed {seed}\n")
        super()._set_seed()

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The trainer methods exposed as subcommands."""
        return {
            "fit": {"model", "datamodule"},
            "test": {"model", "datamodule"},
            "unlearn": {"model", "datamodule"},
            "audit": {"model", "datamodule"},
        }

    def audit(self, **kwargs: Any) -> dict[str, Any]:
        """The trainer's ``audit``; a failed audit exits with status 1 (the Python call returns it)."""
        result = self.trainer.audit(**kwargs)
        if not result["passed"]:
            raise SystemExit(1)
        return result

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Trainer via ``add_class_arguments`` (it is not a Lightning Trainer), model and data as usual."""
        parser.add_class_arguments(
            self.trainer_class,
            "trainer",
            instantiate=False,
            fail_untyped=False,
            sub_configs=True,
            skip={"seed"},
        )
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=True)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=True)
        parser.set_defaults(DEFAULTS)

    def instantiate_classes(self) -> None:
        """Instantiate; a validation error raised inside a class's ``__init__`` becomes a ConfigError."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_numbers(config.as_dict())  # lr 1e300 named here, not by a traceback in the optimizer
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as e:
            if isinstance(e, FedShardError):
                raise
            raise ConfigError(_innermost_reason(str(e))) from None

    def instantiate_trainer(self, **kwargs: Any) -> FederatedTrainer:
        """Build the trainer from its config, with the seed of ``seed_everything``."""
        config = dict(self._get(self.config_init, "trainer", default={}))
        seed = self._get(self.config, "seed_everything")
        config["seed"] = 0 if seed is False or seed is None else int(seed)  # True was drawn by _set_seed
        trainer = self.trainer_class(**config, **kwargs)
        sub = self.subcommand
        if sub is None:  # run=False: the config was parsed without a subcommand
            trainer.record_config(self.parser.dump(self.config))
        else:
            trainer.record_config(self._subcommand_parsers[sub].dump(self.config[sub]))
        return trainer


def main(args: list[str] | None = None) -> None:
    """Entry point; user errors become one line on stderr and exit status 2."""
    argv = sys.argv[1:] if args is None else list(args)
    ignore_sigxfsz()
    terminate_as_interrupt()
    with one_line_errors():
        if no_config_main(argv):
            return
        if argv[:1] == ["compare"]:
            from fedshard_lightning.experiments.compare import main as compare_main

            compare_main(argv[1:], prog="python -m fedshard_lightning compare")
            return
        argv = join_negative_values(argv)
        check_command_line(argv)
        _check_config_files(argv)
        if args is None:
            sys.argv[1:] = argv
        FederatedCLI(args=None if args is None else argv)
