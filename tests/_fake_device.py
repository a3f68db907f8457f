"""A stand-in accelerator on the CPU: tensors that say they live on device ``fdev``, checked like CUDA's.

No CPU test sees a tensor on the wrong device or a host round trip, because on the CPU host and
device are one: commit 28be9e6 handed host indices to a CUDA datamodule's ``index_select``, which
only an H100 found (9 of 12 ``cuda`` tests failed). Here ``torch.device("fdev", 0)`` is torch's
PrivateUse1 backend renamed, with a Python backend: its tensors are wrappers around CPU tensors, so
the arithmetic is the CPU's, but

* an operator given an ``fdev`` tensor and a CPU tensor of one or more dimensions raises, as CUDA
  does (copies between the two, and 0-d CPU tensors, are allowed, as on CUDA);
* ``.item()``, ``bool()``, ``float()``, ``.cpu()`` and data-dependent shapes (``nonzero``,
  boolean masks, ``unique``) of an ``fdev`` tensor are counted as host reads, and ``.numpy()`` and
  ``.tolist()`` raise (as a CUDA tensor's ``.numpy()`` does);
* copies from the host onto ``fdev`` are counted as uploads.

The engine's own device branches see ``fdev`` as "not the CPU" (grouped convolutions, whole-matrix
sums), as they see CUDA. Usage: ``with FakeDevice() as dev: model.to(dev.device) ...``; the
backend is registered once per process.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.utils.backend_registration as backend_registration
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DEVICE", "FakeDevice", "FdevTensor"]

_NAME = "fdev"
_aten = torch.ops.aten
_COPIES = (_aten._to_copy.default, _aten.copy_.default)
# Operators whose output shape depends on the data: CUDA must read it back before returning.
_DATA_SHAPED = (
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim.default,
    _aten.repeat_interleave.Tensor,
)


class _Counts:
    """What the active :class:`FakeDevice` counts (one at a time)."""

    reads: ClassVar[list[str]] = []
    uploads: ClassVar[list[str]] = []


class FdevTensor(torch.Tensor):
    """A CPU tensor (``elem``) that says it lives on ``fdev:0``."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> FdevTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=DEVICE,
            requires_grad=elem.requires_grad,
        )
        r.elem = elem
        return r

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FdevTensor({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})


def _is_fdev(device: Any) -> bool:
    return device is not None and torch.device(device).type == _NAME


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the wrapped CPU tensors, with CUDA's device rule and the host reads counted."""
    flat, _ = tree_flatten((args, kwargs))
    on_dev = any(isinstance(a, FdevTensor) for a in flat)
    if on_dev and func not in _COPIES:
        host = [
            a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, FdevTensor) and a.dim() > 0
        ]
        if host:
            raise RuntimeError(
                f"{func}: expected all tensors to be on the same device, but found at least two "
                f"devices, {DEVICE} and cpu (a host tensor of shape {tuple(host[0].shape)})"
            )
    to_dev = _is_fdev(kwargs.get("device"))
    to_host = on_dev and func is _aten._to_copy.default and not to_dev and kwargs.get("device") is not None
    if on_dev and (func is _aten._local_scalar_dense.default or func in _DATA_SHAPED or to_host):
        _Counts.reads.append(str(func))
    if to_dev and not on_dev and func is _aten._to_copy.default:
        _Counts.uploads.append(str(func))
    if to_dev:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    a, kw = tree_map(lambda t: t.elem if isinstance(t, FdevTensor) else t, (args, kwargs))
    out = func(*a, **kw)
    if func is _aten.copy_.default:
        if isinstance(args[0], FdevTensor) != isinstance(args[1], FdevTensor):
            (_Counts.uploads if isinstance(args[0], FdevTensor) else _Counts.reads).append(str(func))
        if isinstance(args[0], FdevTensor):
            return args[0]
    if to_host or not (on_dev or to_dev):
        return out
    return tree_map(lambda t: FdevTensor(t) if type(t) is torch.Tensor else t, out)


class _Factories(TorchDispatchMode):
    """Catches operators that create ``fdev`` tensors from no ``fdev`` input (``torch.zeros(device=)``)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, FdevTensor) for t in types):
            return NotImplemented
        return _run(func, args, kwargs or {})


# Kernels for what torch.as_tensor(data, device=...) runs below the Python dispatch key.
def _empty_strided(size: Any, stride: Any, dtype: Any = None, **_: Any) -> FdevTensor:
    return FdevTensor(torch.empty_strided(size, stride, dtype=dtype))


def _empty(size: Any, dtype: Any = None, **_: Any) -> FdevTensor:
    return FdevTensor(torch.empty(size, dtype=dtype))


def _copy(self: FdevTensor, src: torch.Tensor, non_blocking: bool = False) -> FdevTensor:
    if not isinstance(src, FdevTensor):
        _Counts.uploads.append("copy_")
    self.elem.copy_(src.elem if isinstance(src, FdevTensor) else src)
    return self


def _copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    (dst.elem if isinstance(dst, FdevTensor) else dst).copy_(
        self.elem if isinstance(self, FdevTensor) else self
    )
    return dst


_registered: list[Any] = []


def _register() -> None:
    """Make PrivateUse1 the ``fdev`` backend, once per process (at import)."""
    if _registered:
        return
    backend_registration._setup_privateuseone_for_python_backend(_NAME)
    lib = torch.library.Library("aten", "IMPL")  # kept alive in _registered
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("copy_", _copy, "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    _registered.append(lib)


_register()
DEVICE = torch.device(_NAME, 0)


class FakeDevice:
    """Context: ``fdev`` tensors can be made and used inside it; ``reads`` and ``uploads`` list what it saw."""

    device = DEVICE

    def __init__(self) -> None:
        self._mode = _Factories()

    def __enter__(self) -> FakeDevice:
        _Counts.reads, _Counts.uploads = [], []
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    @property
    def reads(self) -> list[str]:
        """Host reads so far: one entry per ``.item()``-like read or device-to-host copy."""
        return _Counts.reads

    @property
    def uploads(self) -> list[str]:
        """Host-to-device copies so far."""
        return _Counts.uploads

    def reset(self) -> None:
        """Forget what was counted so far (e.g. after a warm-up)."""
        _Counts.reads.clear()
        _Counts.uploads.clear()
