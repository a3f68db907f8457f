"""``call_hook`` fires the same methods with the same arguments as Lightning's ``Fabric.call``."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from lightning.fabric import Fabric

from fedshard_lightning.callbacks import FederatedCallback
from fedshard_lightning.callbacks.dispatch import call_hook


class Subset(FederatedCallback):
    def __init__(self, log: list) -> None:
        self.log = log

    def on_round_end(self, trainer: Any, metrics: dict) -> None:  # no ``info``
        self.log.append(("subset", trainer, dict(metrics=metrics)))


class Everything(FederatedCallback):
    def __init__(self, log: list) -> None:
        self.log = log

    def on_round_end(self, trainer: Any, **kwargs: Any) -> None:
        self.log.append(("everything", trainer, kwargs))


class Plain:  # not a FederatedCallback: Fabric calls any object with the method
    def __init__(self, log: list) -> None:
        self.log = log

    def on_round_end(self, trainer: Any, info: Any, metrics: dict, extra: int = 0) -> None:
        self.log.append(("plain", trainer, dict(info=info, metrics=metrics, extra=extra)))


class NotCallable:
    on_round_end = 3


def _fire(fire: Any, hook: str, extra: dict) -> tuple[list, list[str]]:
    log: list = []
    instance_level = FederatedCallback()
    instance_level.on_round_end = lambda trainer, info, metrics: log.append(
        ("lambda", trainer, {"info": info})
    )
    callbacks = [Subset(log), FederatedCallback(), Everything(log), Plain(log), NotCallable(), instance_level]
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r in range(3):  # the cache must not change later calls
            fire(fabric, hook, "T", info=r, metrics={"round": r}, **extra)
    return log, [str(w.message) for w in caught]


@pytest.mark.parametrize(("hook", "extra"), [("on_round_end", {}), ("on_stage_end", {"stage": 1})])
def test_same_calls_as_fabric_call(hook, extra):
    want, want_warn = _fire(lambda f, *a, **k: f.call(*a, **k), hook, extra)
    got, got_warn = _fire(call_hook, hook, extra)
    assert got == want
    assert got_warn == want_warn
    if hook == "on_round_end":
        assert [name for name, *_ in got[:5]] == ["subset", "everything", "plain", "lambda", "subset"]
        assert any("not callable" in w for w in got_warn)


class Renamed(FederatedCallback):
    def on_stage_end(self, trainer: Any, stage: int, m: dict) -> None:  # ``metrics`` renamed
        raise AssertionError("never called")


class BrokenBody(FederatedCallback):
    def on_stage_end(self, trainer: Any, stage: int, metrics: dict) -> None:
        len(5)  # the user's own TypeError


def test_a_renamed_hook_parameter_is_one_line_naming_the_hook():
    """Keywords are passed by name, as Fabric.call does; a renamed one had been a bare TypeError."""
    from fedshard_lightning.errors import ContractError

    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[Renamed()])
    with pytest.raises(
        ContractError,
        match=r"Renamed\.on_stage_end cannot take .* name its parameters run, stage, metrics",
    ):
        call_hook(fabric, "on_stage_end", "T", stage=0, metrics={})


def test_a_type_error_inside_a_hook_is_left_alone():
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[BrokenBody()])
    with pytest.raises(TypeError, match="has no len"):
        call_hook(fabric, "on_stage_end", "T", stage=0, metrics={})
