"""Records the arguments an object was constructed with: the source of the cache fingerprint.

jsonargparse builds the model, the data and the algorithm as ``cls(**init_args)``; Python code
does the same by hand. :class:`RecordsInitArgs` catches those arguments in ``__new__`` (before
any ``__init__`` runs, whatever a subclass's ``__init__`` does), binds them to the class's
signature with every default filled in (following ``**kwargs`` up the base classes), and keeps
them as :func:`init_args`. A new constructor argument is therefore fingerprinted without anyone
remembering to add it to a list.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["RecordsInitArgs", "init_args", "jsonable"]


def _bind(cls: type, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by name, with the defaults of ``cls.__init__`` and of the bases that ``**kwargs`` reaches."""
    out: dict[str, Any] = {}
    pending_args, pending_kwargs = args, dict(kwargs)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            sig = inspect.signature(init)
            bound = sig.bind_partial(None, *pending_args, **pending_kwargs)
        except (TypeError, ValueError):
            return {**out, **pending_kwargs}
        bound.apply_defaults()
        var_kw = var_pos = None
        for name, param in sig.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                var_kw = name
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                var_pos = name
            elif name != next(iter(sig.parameters)) and name in bound.arguments:
                out.setdefault(name, bound.arguments[name])
        if var_kw is None:
            return out
        pending_args = tuple(bound.arguments.get(var_pos, ())) if var_pos else ()
        pending_kwargs = dict(bound.arguments.get(var_kw, {}))
    return {**out, **pending_kwargs}


def jsonable(value: Any) -> Any:
    """A JSON-stable form: objects that record init args become ``{class_path, init_args}``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    recorded = getattr(value, "_init_args", None)
    if isinstance(recorded, dict):
        cls = type(value)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": jsonable(recorded)}
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


class RecordsInitArgs:
    """Mixin: remember the constructor arguments (see the module docstring)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Create the object and record ``args``/``kwargs`` bound to the signature."""
        obj = super().__new__(cls)
        object.__setattr__(obj, "_init_args", _bind(cls, args, kwargs))
        return obj


def init_args(obj: Any) -> dict[str, Any]:
    """``{class_path, init_args}`` of an object (its init args when it records them)."""
    if isinstance(getattr(obj, "_init_args", None), dict):
        return jsonable(obj)
    # A plain LightningModule records its arguments only through save_hyperparameters().
    hparams = getattr(obj, "hparams", None)
    return {
        "class_path": f"{type(obj).__module__}.{type(obj).__qualname__}",
        "init_args": jsonable(dict(hparams)) if hparams else {},
    }
