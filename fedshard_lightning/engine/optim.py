"""Re-creating the user's optimizer on stacked client parameters.

The engine asks the model's ``configure_optimizers`` once, checks that the optimizer is
element-wise (each coordinate's update depends only on that coordinate's history, so stacking
clients along a new leading dimension does not couple them), and then builds a fresh instance of
the same class, with the same hyper-parameters, over the stacked leaves in every round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedshard_lightning.errors import ContractError

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "OptimizerSpec",
    "normalize_optimizer",
    "optimizer_spec",
    "shrink_optimizer",
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


def normalize_optimizer(returned: Any, owner: str) -> torch.optim.Optimizer:
    """Reduce the forms ``configure_optimizers`` may return to one optimizer, refusing schedulers."""
    opt = returned
    if isinstance(opt, dict):
        if opt.get("lr_scheduler") is not None:
            raise ContractError(
                f"{owner}.configure_optimizers returns a learning-rate scheduler: client optimizers are re-created "
                "every round, so schedulers are not supported; return only the optimizer"
            )
        opt = opt.get("optimizer")
    if isinstance(opt, (list, tuple)):
        if len(opt) == 2 and isinstance(opt[0], (list, tuple)):
            if opt[1]:
                raise ContractError(
                    f"{owner}.configure_optimizers returns a learning-rate scheduler: not supported; "
                    "return only the optimizer"
                )
            opt = opt[0]
        if len(opt) != 1:
            raise ContractError(
                f"{owner}.configure_optimizers must return exactly one optimizer, got {len(opt)}"
            )
        opt = opt[0]
    if not isinstance(opt, torch.optim.Optimizer):
        raise ContractError(
            f"{owner}.configure_optimizers must return a torch.optim.Optimizer, got {type(opt).__name__}"
        )
    return opt


@dataclass(frozen=True)
class OptimizerSpec:
    """Class and per-group hyper-parameters of the client optimizer, by parameter name."""

    cls: type[torch.optim.Optimizer]
    groups: tuple[tuple[tuple[str, ...], dict[str, Any]], ...]

    def build(self, leaves: dict[str, Tensor], prefix: str = "") -> torch.optim.Optimizer:
        """A fresh optimizer over stacked leaves keyed by (prefixed) parameter name."""
        return self.cls([{"params": [leaves[prefix + n] for n in names], **hp} for names, hp in self.groups])


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
