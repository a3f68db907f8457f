"""The repeated-evaluation fast path against ``functional_call`` evaluation (the reference)."""

from __future__ import annotations

import torch
from torch import nn

from fedshard_lightning.engine.evaluate import Evaluator, evaluate


class _BNDropNet(nn.Module):
    """BatchNorm and dropout (eval mode matters), and a frozen layer (read from the live module)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 8)
        self.frozen.requires_grad_(False)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.bn(self.frozen(x)))))


def _params(net: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Trained-like values of the parameters and BN statistics, as the engine passes them."""
    out = {k: torch.randn(v.shape, generator=gen) for k, v in net.named_parameters() if v.requires_grad}
    out["bn.running_mean"] = torch.randn(8, generator=gen)
    out["bn.running_var"] = torch.rand(8, generator=gen) + 0.5
    return out


def _reference(net: nn.Module, params: dict[str, torch.Tensor], x, y, batch: int) -> tuple[float, float]:
    """Accuracy and loss from ``torch.func.functional_call`` logits in eval mode, batches of the same size.

    Written here with torch alone (no project code), so it checks the evaluator independently.
    """
    net.eval()
    try:
        with torch.no_grad():
            logits = torch.cat(
                [
                    torch.func.functional_call(net, params, (x[i : i + batch],))
                    for i in range(0, len(x), batch)
                ]
            )
    finally:
        net.train()
    loss = torch.nn.functional.cross_entropy(logits.double(), y).item()
    return (logits.argmax(-1) == y).double().mean().item(), loss


def test_evaluator_gives_the_bits_of_functional_call_and_leaves_the_module_alone():
    gen = torch.Generator().manual_seed(0)
    net = _BNDropNet().train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = torch.randn(50, 6, generator=gen), torch.randint(0, 3, (50,), generator=gen)
    ev = Evaluator(net, batch_size=16)  # several batches
    for _ in range(3):
        params = _params(net, gen)
        assert ev(params, x, y) == _reference(net, params, x, y, 16)
    assert Evaluator(net)(params, x, y) == evaluate(net, params, x, y)
    one = Evaluator(net)  # one batch: the forward without slicing or concatenation
    for _ in range(2):
        params = _params(net, gen)
        assert one(params, x, y) == _reference(net, params, x, y, 2048)
    partial = {
        k: v for k, v in _params(net, gen).items() if k != "head.bias"
    }  # other names: the rest is live
    assert one(partial, x, y) == _reference(net, partial, x, y, 2048)
    with torch.no_grad():  # the frozen layer changes: the next evaluation must see it
        net.frozen.weight.mul_(2.0)
    params = _params(net, gen)
    assert ev(params, x, y) == _reference(net, params, x, y, 16)
    assert net.training
    after = net.state_dict()
    assert torch.equal(after["frozen.weight"], before["frozen.weight"] * 2.0)
    assert all(torch.equal(after[k], before[k]) for k in before if k != "frozen.weight")


def test_a_module_that_cannot_be_copied_is_evaluated_in_place():
    """A user's module holding a lock (deepcopy raises) still evaluates, by ``functional_call``."""
    import threading

    gen = torch.Generator().manual_seed(1)
    net = _BNDropNet().train()
    net.lock = threading.Lock()
    x, y = torch.randn(20, 6, generator=gen), torch.randint(0, 3, (20,), generator=gen)
    params = _params(net, gen)
    ev = Evaluator(net)
    assert ev(params, x, y) == evaluate(net, params, x, y)
    assert ev(params, x, y) == evaluate(net, params, x, y) and net.training


def test_prepared_evaluator_equals_a_lazy_one():
    """``prepare`` makes the copy ahead (the trainer's setup); the results are those of a lazy copy."""
    import threading

    gen = torch.Generator().manual_seed(2)
    net = _BNDropNet().train()
    x, y = torch.randn(30, 6, generator=gen), torch.randint(0, 3, (30,), generator=gen)
    early, lazy = Evaluator(net), Evaluator(net)
    early.prepare()
    assert early._copy is not None and lazy._copy is None
    copy_made = early._copy
    early.prepare()  # once made, kept
    assert early._copy is copy_made
    for _ in range(2):
        params = _params(net, gen)
        assert early(params, x, y) == lazy(params, x, y) == _reference(net, params, x, y, 2048)
    net.lock = threading.Lock()  # cannot be copied: prepare refuses quietly, calls evaluate in place
    refused = Evaluator(net)
    refused.prepare()
    assert refused._copy is None and not refused._copyable
    params = _params(net, gen)
    assert refused(params, x, y) == evaluate(net, params, x, y)
