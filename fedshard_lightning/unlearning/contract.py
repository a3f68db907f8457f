"""What the trainer checks of an :class:`~fedshard_lightning.unlearning.base.Algorithm` it calls.

A user's method (docs/extending.md) is one subclass; the trainer calls it at fixed points. A
method left out, or a wrong return there, had ended in a traceback far from the cause
(``NotImplementedError``, ``'NoneType' object is not iterable`` in the evaluator, a set that
JSON cannot store in the cache). Each check stops in one line naming the class, the method and
what it must return.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from torch import Tensor

from fedshard_lightning.errors import ContractError


class _Algorithm(Protocol):
    """What the checks read of an algorithm: its class name (in the message) and its initial model."""

    theta0: dict[str, Tensor] | None


__all__ = [
    "REQUIRED",
    "UnlearnResult",
    "check_cost",
    "check_params",
    "check_result",
    "check_state_json",
    "is_tensor_dict",
]

REQUIRED = ("fit", "current_params", "predict_cost", "retrain_cost", "unlearn")
"""The methods every algorithm defines (the base class's raise ``NotImplementedError``)."""


@dataclass
class UnlearnResult:
    """The unlearned model and what it cost."""

    params: dict[str, Tensor]
    client_steps: int
    predicted_client_steps: int
    retrain_client_steps: int
    seconds: float
    server_seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


def is_tensor_dict(value: Any) -> bool:
    """A non-empty dict of tensors: what the default ``cache_files`` stores as safetensors."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, Tensor) for v in value.values())


def _kind(value: Any) -> str:
    return type(value).__name__


def check_params(alg: _Algorithm, params: Any, method: str) -> dict[str, Tensor]:
    """``params`` if it is a model like ``theta0`` (same names and shapes), else a one-line error."""
    where = f"trainer.algorithm: {type(alg).__name__}.{method}()"
    if not isinstance(params, dict) or not params or not all(isinstance(v, Tensor) for v in params.values()):
        raise ContractError(
            f"{where} must return the model's parameters as a dict of name -> tensor (like self.theta0), "
            f"got {_kind(params)}"
        )
    like = alg.theta0 or {}
    missing, extra = sorted(set(like) - set(params)), sorted(set(params) - set(like))
    if like and (missing or extra):
        raise ContractError(
            f"{where} returned other names than the model's: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for k, v in like.items():
        if params[k].shape != v.shape:
            raise ContractError(
                f"{where} returned {k} of shape {tuple(params[k].shape)}; the model's is {tuple(v.shape)}"
            )
    return params


def check_cost(alg: _Algorithm, value: Any, what: str) -> int:
    """``value`` as an int if it is a whole number of client-steps >= 0, else a one-line error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ContractError(
            f"trainer.algorithm: {type(alg).__name__}.{what} must be an int (client-steps, >= 0), "
            f"got {value!r} ({_kind(value)})"
        )
    return int(value)


def check_result(alg: _Algorithm, result: Any, seconds: float) -> UnlearnResult:
    """The checked result of ``unlearn``; ``seconds`` (its wall time) fills a result that did not time itself."""
    if not isinstance(result, UnlearnResult):
        raise ContractError(
            f"trainer.algorithm: {type(alg).__name__}.unlearn() must return an UnlearnResult(params, client_steps, "
            f"predicted_client_steps, retrain_client_steps, seconds), got {_kind(result)}"
        )
    check_params(alg, result.params, "unlearn")
    for f in ("client_steps", "predicted_client_steps", "retrain_client_steps"):
        check_cost(alg, getattr(result, f), f"unlearn().{f}")
    return result if result.seconds else replace(result, seconds=seconds)


def check_state_json(alg: _Algorithm, state: dict[str, Any]) -> None:
    """Refuse a state field that the cache cannot store as JSON (and that is no dict of tensors)."""
    for name, value in state.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            reason = str(e)
        else:
            keys = _keys_not_str(value)
            if not keys:
                continue
            reason = f"the key {keys[0]!r} would come back from the cache as {json.dumps(keys[0])!r}"
        raise ContractError(
            f"trainer.algorithm: {type(alg).__name__}'s state field {name!r} is neither a dict of tensors nor "
            f"JSON ({reason}); store lists, numbers and strings (str keys), or override cache_files/restore_cache"
        )


def _keys_not_str(value: Any) -> list[Any]:
    """The dict keys in ``value`` that are not strings (JSON turns them into strings)."""
    if isinstance(value, dict):
        return [k for k in value if not isinstance(k, str)] or [
            k for v in value.values() for k in _keys_not_str(v)
        ]
    if isinstance(value, (list, tuple)):
        return [k for v in value for k in _keys_not_str(v)]
    return []
