"""Re-creating the user's optimizer on stacked client parameters.

The engine asks the model's ``configure_optimizers`` once, checks that the optimizer is
element-wise (each coordinate's update depends only on that coordinate's history, so stacking
clients along a new leading dimension does not couple them), and then builds a fresh instance of
the same class, with the same hyper-parameters, over the stacked leaves in every round.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from fedshard_lightning.errors import ContractError

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "OptimizerSpec",
    "RoundLR",
    "fused_sgd_lr",
    "normalize_optimizer",
    "optimizer_spec",
    "round_lr",
    "scheduler_frequency",
    "shrink_optimizer",
    "state_kept",
]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
)


def split_configured(returned: Any, owner: str) -> tuple[torch.optim.Optimizer, Any]:
    """Reduce the forms ``configure_optimizers`` may return to one optimizer and its scheduler (or None)."""
    opt, sched = returned, None
    if isinstance(opt, dict):
        sched = opt.get("lr_scheduler")
        opt = opt.get("optimizer")
    if isinstance(opt, (list, tuple)):
        if len(opt) == 2 and isinstance(opt[0], (list, tuple)):
            scheds = list(opt[1]) if isinstance(opt[1], (list, tuple)) else [opt[1]]
            if len(scheds) > 1:
                raise ContractError(
                    f"{owner}.configure_optimizers returns {len(scheds)} learning-rate schedulers; return at most one"
                )
            sched = scheds[0] if scheds else None
            opt = opt[0]
        if len(opt) != 1:
            raise ContractError(
                f"{owner}.configure_optimizers must return exactly one optimizer, got {len(opt)}"
            )
        opt = opt[0]
    if isinstance(sched, dict):  # Lightning's {"scheduler": ..., "interval": ...} form
        _check_interval(sched, owner)
        sched = sched.get("scheduler")
    if not isinstance(opt, torch.optim.Optimizer):
        raise ContractError(
            f"{owner}.configure_optimizers must return a torch.optim.Optimizer, got {type(opt).__name__}"
        )
    if sched is not None and not hasattr(sched, "step"):
        raise ContractError(
            f"{owner}.configure_optimizers returns lr_scheduler {type(sched).__name__}, which has no step(); "
            "return a torch.optim.lr_scheduler object"
        )
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ContractError(
            f"{owner}.configure_optimizers returns ReduceLROnPlateau: its learning rate depends on a monitored "
            "metric, not on the round, so a retrained shard could not replay it; use a round-based scheduler"
        )
    return opt, sched


def _check_interval(config: dict[str, Any], owner: str) -> None:
    """Refuse ``interval: step``: schedulers step once per round (clients re-create their optimizer)."""
    if config.get("interval", "epoch") != "epoch":
        raise ContractError(
            f"{owner}.configure_optimizers returns lr_scheduler interval={config['interval']!r}; the engine "
            "steps schedulers once per communication round: use interval 'epoch' (frequency n: every n rounds)"
        )
    freq = config.get("frequency", 1)
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ContractError(
            f"{owner}.configure_optimizers returns lr_scheduler frequency={freq!r}; use a positive int (rounds)"
        )


def scheduler_frequency(returned: Any) -> int:
    """Rounds per scheduler step: Lightning's ``frequency`` key of an ``lr_scheduler`` dict (default 1)."""
    sched = returned.get("lr_scheduler") if isinstance(returned, dict) else None
    if isinstance(returned, (list, tuple)) and len(returned) == 2 and isinstance(returned[0], (list, tuple)):
        scheds = list(returned[1]) if isinstance(returned[1], (list, tuple)) else [returned[1]]
        sched = scheds[0] if scheds else None
    return int(sched.get("frequency", 1)) if isinstance(sched, dict) else 1


def normalize_optimizer(returned: Any, owner: str) -> torch.optim.Optimizer:
    """The optimizer of what ``configure_optimizers`` returned (its scheduler, if any, set aside)."""
    return split_configured(returned, owner)[0]


class RoundLR:
    """Learning rate of every optimizer group in a round: the user's scheduler stepped once per round.

    Federated convention: client optimizers are re-created in every communication round, so the
    scheduler counts rounds, not local steps. The rate of round ``r`` is what a fresh
    ``configure_optimizers()`` scheduler gives after ``r // frequency`` steps (Lightning's
    ``frequency`` key, default 1), a function of the round alone: a resumed or retrained shard
    replays the same rates. Values are cached per round.

    Args:
        module: The model whose ``configure_optimizers`` returns an optimizer and a scheduler.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._cache: dict[int, list[float]] = {}

    def __call__(self, round_: int) -> list[float]:
        """Learning rate per optimizer group in round ``round_`` (0-based)."""
        if round_ not in self._cache:
            owner = type(self.module).__name__
            returned = self.module.configure_optimizers()
            opt, sched = split_configured(returned, owner)
            with warnings.catch_warnings():  # scheduler.step() before optimizer.step() is intended
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(round_ // scheduler_frequency(returned)):
                    sched.step()
            self._cache[round_] = [float(g["lr"]) for g in opt.param_groups]
        return self._cache[round_]

    @staticmethod
    def apply(opt: torch.optim.Optimizer, lrs: Sequence[float]) -> None:
        """Set the optimizer's group learning rates (group order as in ``configure_optimizers``)."""
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr


def round_lr(module: nn.Module) -> RoundLR | None:
    """The per-round learning rates of the model's scheduler, or None when it has none."""
    _, sched = split_configured(module.configure_optimizers(), type(module).__name__)
    return None if sched is None else RoundLR(module)


@dataclass(frozen=True)
class OptimizerSpec:
    """Class and per-group hyper-parameters of the client optimizer, by parameter name."""

    cls: type[torch.optim.Optimizer]
    groups: tuple[tuple[tuple[str, ...], dict[str, Any]], ...]

    def build(self, leaves: dict[str, Tensor], prefix: str = "") -> torch.optim.Optimizer:
        """A fresh optimizer over stacked leaves keyed by (prefixed) parameter name."""
        return self.cls([{"params": [leaves[prefix + n] for n in names], **hp} for names, hp in self.groups])

    def with_lrs(self, lrs: Sequence[float]) -> OptimizerSpec:
        """The same spec with these group learning rates (a round of the scheduler)."""
        groups = tuple((names, {**hp, "lr": lr}) for (names, hp), lr in zip(self.groups, lrs, strict=True))
        return replace(self, groups=groups)


def optimizer_spec(module: nn.Module, names: Sequence[str]) -> OptimizerSpec:
    """Inspect ``module.configure_optimizers()`` and check the contract."""
    owner = type(module).__name__
    opt = normalize_optimizer(module.configure_optimizers(), owner)
    if type(opt) not in ELEMENTWISE_OPTIMIZERS:
        allowed = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ContractError(
            f"{owner}.configure_optimizers returns {type(opt).__name__}, which is not an element-wise optimizer; "
            f"clients are trained stacked, so use one of {allowed}"
        )
    by_id = {id(p): n for n, p in module.named_parameters()}
    groups = []
    seen: set[str] = set()
    for group in opt.param_groups:
        gnames = []
        for p in group["params"]:
            if id(p) not in by_id:
                raise ContractError(
                    f"{owner}.configure_optimizers optimizes a tensor that is not a model parameter"
                )
            if p.requires_grad:  # a frozen parameter never gets a gradient: torch.optim skips it
                gnames.append(by_id[id(p)])
        seen.update(gnames)
        hp = {k: v for k, v in group.items() if k not in ("params", "initial_lr", "param_names")}
        groups.append((tuple(gnames), hp))
    missing = [n for n in names if n not in seen]
    if missing:
        raise ContractError(
            f"{owner}.configure_optimizers leaves trainable parameters out of the optimizer: {missing[:3]}; "
            "optimize all trainable parameters or set requires_grad=False on frozen ones"
        )
    return OptimizerSpec(type(opt), tuple(groups))


def fused_sgd_lr(spec: OptimizerSpec) -> dict[str, float] | None:
    """Learning rate by parameter when the client optimizer is plain SGD, which the chain fuses into backward.

    None for anything else (momentum, weight decay, maximize, a tensor learning rate, another class).
    """
    if spec.cls is not torch.optim.SGD:
        return None
    lr = {}
    for names, hp in spec.groups:
        plain = (
            hp.get("momentum", 0) == 0
            and hp.get("weight_decay", 0) == 0
            and not hp.get("maximize", False)
            and not isinstance(hp.get("lr"), Tensor)
        )
        if not plain:
            return None
        lr.update(dict.fromkeys(names, float(hp["lr"])))
    return lr


def shrink_optimizer(
    opt: torch.optim.Optimizer, old: Sequence[Tensor], new: Sequence[Tensor], m: int
) -> None:
    """Keep only the first ``m`` stacked clients: swap leaves and slice per-parameter state."""
    remap = {id(o): n for o, n in zip(old, new)}
    for group in opt.param_groups:
        group["params"] = [remap[id(p)] for p in group["params"]]
    for o, n in zip(old, new):
        state = opt.state.pop(o, None)
        if state is not None:
            opt.state[n] = {
                k: (v[:m] if isinstance(v, Tensor) and v.ndim > 0 and v.shape == o.shape else v)
                for k, v in state.items()
            }


def state_kept(spec: OptimizerSpec) -> list[str]:
    """The per-parameter state the client optimizer keeps between steps (``exp_avg``, ``momentum_buffer``...).

    Found by one step of each parameter group's settings on a small tensor (torch's optimizers
    create their state on the first step); [] for plain SGD, whose rounds lose nothing to the
    fresh optimizer each round starts with.
    """
    names: set[str] = set()
    for _, hp in spec.groups:
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        try:
            opt = spec.cls([{"params": [p], **hp}])
            opt.step()
        except (RuntimeError, ValueError, TypeError):  # settings for another device (capturable): unknown
            continue
        names.update(k for k, v in opt.state[p].items() if isinstance(v, Tensor) and k != "step")
    return sorted(names)
