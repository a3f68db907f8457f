"""What the paper's experiments share: the setting, fitting one method, costs, fairness, JSON.

The cascade (:mod:`~fedshard_lightning.experiments.cascade`) and poisoning
(:mod:`~fedshard_lightning.experiments.poisoning`) experiments of the FedShard paper's Appendix
G.5 train every method on the same "two label partitions" setting and then ask what-ifs of the
trained state. Those what-ifs go through the algorithm's pure
:meth:`~fedshard_lightning.unlearning.base.Algorithm.what_if`, never through ``unlearn`` on
disk, and are scored by :func:`~fedshard_lightning.metrics.fairness_report.fairness_report`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.metrics.client_alpha import client_alphas, per_client_accuracy
from fedshard_lightning.metrics.fairness_report import fairness_report, json_safe
from fedshard_lightning.unlearning.base import Algorithm

if TYPE_CHECKING:
    from fedshard_lightning.trainer.trainer import FederatedTrainer

__all__ = [
    "ExperimentSetting",
    "MethodRun",
    "default_algorithms",
    "fit_method",
    "minority_clients",
    "mp_score",
    "request_cost",
    "run_cli",
    "seeded_model",
    "with_seed",
    "write_json",
]


def default_algorithms() -> list[Algorithm]:
    """FedShard (the digits defaults) and FedAvg retraining with a comparable budget."""
    from fedshard_lightning.unlearning import FedAvg, FedShard

    return [
        FedShard(merge_rate=2, merge="a1", rounds="a2", t0=2, t1=8, batch_size=10, local_epochs=2),
        FedAvg(rounds=20, batch_size=10, local_epochs=2),
    ]


def minority_clients(datamodule: FederatedDataModule) -> list[int]:
    """Clients of the smaller group of a ``label_split`` partition (the second group when equal).

    The partition puts the first ``round(K * label_split_fraction)`` clients on the first half of
    the labels and the rest on the other half.
    """
    k = datamodule.num_clients
    k_first = min(max(round(k * datamodule.label_split_fraction), 1), k - 1)
    first, second = list(range(k_first)), list(range(k_first, k))
    return first if len(first) < len(second) else second


def seeded_model(model: L.LightningModule, seed: int) -> L.LightningModule:
    """A copy of ``model`` whose built layers are drawn again from ``seed``, as ``fit`` draws them.

    A FederatedModule built later (by the trainer, after it seeds) has no layers yet and is only
    copied. A plain LightningModule built its layers in ``__init__``, from whatever the random
    state held when the config was read: every invocation of an experiment started from other
    weights, and every seed of one invocation from the same. ``reset_parameters`` of each layer
    under ``torch.manual_seed(seed)`` draws them as constructing the model under that seed does
    (layers registered in construction order); the caller's random state is left as it was.
    """
    out = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for sub in out.modules():
            reset = getattr(sub, "reset_parameters", None)
            if sub is not out and callable(reset):
                reset()
    return out


def with_seed(data: FederatedDataModule, seed: int) -> FederatedDataModule:
    """A fresh copy of ``data`` whose partition (and generated samples) use ``seed``.

    Rebuilt from its recorded init args rather than copied and patched, so that what the run
    records of it (``cache/FINGERPRINT``'s ``data_settings``) names the seed it really used, and a
    template that is already set up draws its partition again.
    """
    args = getattr(data, "_init_args", None)
    if isinstance(args, dict) and "seed" in args:
        return type(data)(**{**args, "seed": seed})
    out = copy.deepcopy(data)
    out.seed = seed
    return out


@dataclass
class ExperimentSetting:
    """What every method of an experiment shares: data, model template, trainer settings."""

    output_dir: Path
    datamodule: FederatedDataModule
    model: L.LightningModule
    algorithms: list[Algorithm]
    seed: int = 0
    precision: str = "32-true"
    accelerator: str = "cpu"
    vectorize: str = "auto"
    eval_every_n_rounds: int = 0
    holdout: bool = False
    reference: dict[str, Tensor] | None = None
    alphas: Tensor | None = None

    @classmethod
    def build(
        cls,
        output_dir: str | Path,
        algorithms: list[Algorithm] | None,
        model: L.LightningModule | None,
        data: FederatedDataModule | None,
        num_clients: int,
        label_split_fraction: float,
        seed: int,
        **kwargs: Any,
    ) -> ExperimentSetting:
        """Defaults: Digits with a 0.75 label split, an MLP(64, 64), FedShard and FedAvg.

        ``seed`` is also the partition seed of a given datamodule (a copy; as in ``compare``), so
        that repeating an experiment over seeds repeats it over data splits too.
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ConfigError(f"seed={seed!r}: must be an integer in [0, 2**32)")
        if data is not None:
            data = with_seed(data, seed)
        else:
            from fedshard_lightning.data import DigitsDataModule

            data = DigitsDataModule(
                num_clients=num_clients,
                partition="label_split",
                label_split_fraction=label_split_fraction,
                seed=seed,
                holdout_fraction=0.2 if kwargs.get("holdout") else 0.0,
            )
        if kwargs.get("holdout") and not data.holdout_fraction > 0:
            raise ConfigError(
                f"holdout: true but data.holdout_fraction={data.holdout_fraction}: the clients hold no "
                "held-out samples to measure; set data.holdout_fraction (e.g. 0.2) or holdout: false"
            )
        if data.partition != "label_split":
            raise ConfigError(
                f"data.partition={data.partition!r}: this experiment needs the two-label-partition split "
                "(partition: label_split)"
            )
        if model is None:
            from fedshard_lightning.models import MLP

            model = MLP(hidden=(64, 64), lr=0.1)
        algorithms = list(algorithms) if algorithms else default_algorithms()
        names = [a.name for a in algorithms]
        if len(set(names)) != len(names):
            raise ConfigError(f"algorithms: each method may appear once, got {names}")
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        return cls(out, data, model, algorithms, seed=seed, **kwargs)


@dataclass
class MethodRun:
    """One method trained on the setting: its trainer, the fitted state and its per-client accuracy."""

    trainer: FederatedTrainer
    algorithm: Algorithm
    params: dict[str, Tensor]
    acc: Tensor
    fit_metrics: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def what_if(self, state: dict[str, Any], clients: list[int]) -> tuple[dict[str, Any], Any]:
        """The state and result of unlearning ``clients`` from ``state`` (pure: nothing is written)."""
        return self.algorithm.what_if(state, clients)

    def accuracy(self, params: dict[str, Tensor]) -> Tensor:
        """Per-client accuracy of another model of this method."""
        split = "holdout" if self.extra.get("holdout") else "train"
        return per_client_accuracy(self.trainer.module, params, self.trainer.datamodule, split)


def fit_method(setting: ExperimentSetting, algorithm: Algorithm) -> MethodRun:
    """Train ``algorithm`` on the setting (a fresh copy of the model template, same theta^0 seed).

    The first method fitted also fixes the shared client alphas (SPEC section 4: methods compared
    side by side share one reference model).
    """
    from fedshard_lightning.trainer.trainer import FederatedTrainer

    trainer = FederatedTrainer(
        algorithm=algorithm,
        accelerator=setting.accelerator,
        precision=setting.precision,
        default_root_dir=str(setting.output_dir / "runs"),
        run_name=None,
        vectorize=setting.vectorize,
        eval_every_n_rounds=setting.eval_every_n_rounds,
        enable_progress_bar=False,
        enable_fairness=False,  # the experiment measures fairness itself, with the shared alphas
        seed=setting.seed,
    )
    metrics = trainer.fit(seeded_model(setting.model, setting.seed), setting.datamodule)
    params = {k: v.detach().clone() for k, v in algorithm.current_params().items()}
    run = MethodRun(trainer, algorithm, params, torch.zeros(0), metrics, {"holdout": setting.holdout})
    run.state = algorithm.state_dict()
    run.acc = run.accuracy(params)
    if setting.alphas is None:
        setting.reference = params
        setting.alphas = client_alphas(algorithm, params).cpu()
    return run


def request_cost(result: Any, run: MethodRun, unit: str) -> float:
    """Cost of an unlearning request relative to the cost of the original fit (unit-free)."""
    if unit == "seconds":
        fit = float(run.fit_metrics.get("seconds") or 0.0)
        return float(result.seconds) / fit if fit > 0 else 0.0
    fit_steps = float(run.fit_metrics.get("client_steps") or 0)
    return float(result.client_steps) / fit_steps if fit_steps > 0 else 0.0


def mp_score(
    setting: ExperimentSetting, delta: Tensor, leaving: list[int], eps0: float, eps1: float
) -> float:
    """M_p of one request with the shared client alphas."""
    return fairness_report(delta, torch.zeros_like(delta), setting.alphas, leaving, eps0, eps1)["M_p"]


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write JSON with NaN/inf as null."""
    path.write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
    return path


def run_cli(function: Any, args: list[str] | None, prog: str | None = None) -> Any:
    """Run an experiment function from the command line; bad input is one ``error:`` line, exit 2.

    Parse errors are handled by the parser; a :class:`~fedshard_lightning.errors.FedShardError`
    raised by the experiment or by a class of its config (a value out of range) would otherwise
    end in a traceback. ``prog`` is the command as the user typed it (default:
    ``python -m`` and the function's module).
    """
    import sys

    from jsonargparse import CLI

    from fedshard_lightning.errors import FedShardError
    from fedshard_lightning.launch.parse_errors import PlainHelpParser

    try:
        module = function.__module__  # "__main__" under python -m: its spec has the real name
        spec = getattr(sys.modules.get(module), "__spec__", None) if module == "__main__" else None
        prog = prog or f"python -m {spec.name if spec else module}"  # argparse would say compare.py
        return CLI(function, args=args, as_positional=False, parser_class=PlainHelpParser, prog=prog)
    except Exception as e:
        # jsonargparse wraps an error raised while instantiating a class of the config (an
        # algorithm with rounds: 0) in a ValueError; the user's error is in the cause chain.
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, FedShardError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        sys.stderr.write(f"error: {' '.join(str(cause).split())}\n")
        raise SystemExit(2) from None
