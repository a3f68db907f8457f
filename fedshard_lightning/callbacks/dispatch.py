"""``Fabric.call`` without re-reading every callback's signature at every round.

``Fabric.call`` filters the keyword arguments by ``inspect.signature`` of each callback's method
on every call: with the default callbacks, 5 signatures per round, a few percent of a small
model's fit. :func:`call_hook` does
what ``Fabric.call`` does, in the same order with the same arguments, but keeps the filter per
method function, and skips the base class's no-op hooks.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.errors import ContractError

__all__ = ["call_hook"]

# function -> names it accepts (None: it takes **kwargs, pass everything); per process.
_ACCEPTS: dict[Any, frozenset[str] | None] = {}


def _signature_names(method: Any) -> frozenset[str] | None:
    try:
        params = inspect.signature(method).parameters.values()
    except (ValueError, TypeError):  # no signature: pass everything, as Fabric does
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def _accepts(method: Any) -> frozenset[str] | None:
    func = getattr(method, "__func__", method)
    try:
        if func not in _ACCEPTS:
            _ACCEPTS[func] = _signature_names(method)
        return _ACCEPTS[func]
    except TypeError:  # an unhashable callable: read its signature every time
        return _signature_names(method)


def call_hook(fabric: Fabric, hook: str, *args: Any, **kwargs: Any) -> None:
    """Fire ``hook`` on every callback of ``fabric`` that implements it (as ``Fabric.call``)."""
    base = getattr(FederatedCallback, hook, None)
    for callback in fabric._callbacks:
        method = getattr(callback, hook, None)
        if method is None or (base is not None and getattr(method, "__func__", None) is base):
            continue
        if not callable(method):
            rank_zero_warn(
                f"Skipping the callback `{type(callback).__name__}.{hook}` because it is not callable."
            )
            continue
        names = _accepts(method)
        passed = kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}
        try:
            method(*args, **passed)
        except TypeError:
            _check_signature(callback, hook, method, args, passed, kwargs)
            raise


def _check_signature(
    callback: Any, hook: str, method: Any, args: tuple, passed: dict[str, Any], kwargs: dict[str, Any]
) -> None:
    """Name a hook whose parameters the call cannot fill (a renamed one), instead of a bare TypeError.

    Hooks receive the run's view positionally and the rest by keyword, by name (as ``Fabric.call``
    does): ``on_stage_end(self, run, stage, m)`` never gets ``m``. Only called once the hook
    raised, so the rounds pay nothing; a TypeError from inside the hook's body is left alone.
    """
    try:
        inspect.signature(method).bind(*args, **passed)
    except TypeError as e:
        wanted = ", ".join(["run", *kwargs])
        raise ContractError(
            f"trainer.callbacks: {type(callback).__name__}.{hook} cannot take the hook's arguments ({e}); "
            f"name its parameters {wanted} (FederatedCallback.{hook}), or take **kwargs"
        ) from None
    except ValueError:  # no signature to bind
        return
