"""Bounded inputs below the CLI: the YAML checker on real and hostile documents, the batch-size cut.

The command-line cases (one line, exit 2, nothing written) are in test_bad_input_matrix.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny import tiny_data, tiny_model

from fedshard_lightning.cli.inputs import join_negative_values
from fedshard_lightning.cli.yaml_bounds import MAX_DEPTH, check_yaml
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.models import MLP

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for folder in ("configs", "callbacks") for p in (ROOT / folder).rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_every_shipped_config_is_within_the_bounds(path):
    check_yaml(path.read_text(), str(path), "fix it")


def test_shared_anchors_and_merge_keys_are_fine():
    check_yaml("base: &b {lr: 0.1, momentum: 0.9}\nmodel: {<<: *b, lr: 0.2}\nother: *b\n", "doc", "fix")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            "a: &a [x, x]\n"
            + "".join(f"l{i}: &l{i} [*{'a' if i == 0 else f'l{i - 1}'}, " * 1 + "]\n" for i in range(3)),
            None,
        ),
        ("k: 1\nk: 2\n", "given twice"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nested deeper"),
        ("a: &a [*a]\n", "contains it"),
    ],
    ids=["small-aliases", "duplicate", "deep", "recursive"],
)
def test_hostile_documents(text, why):
    if why is None:
        check_yaml(text, "doc", "fix")  # a few aliases of aliases are fine
        return
    with pytest.raises(ConfigError, match=why):
        check_yaml(text, "doc", "fix")


def test_a_billion_laughs_is_refused_without_expanding_it():
    """10 levels of 9 aliases: 9**10 values; only the count is computed, so the refusal is immediate."""
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    with pytest.raises(ConfigError, match="billion laughs"):
        check_yaml("\n".join(levels) + "\n", "doc", "fix")


def test_negative_numbers_after_a_flag_are_values():
    argv = ["fit", "--model.lr", "-inf", "--a", "-1e-3", "--b", "--c", "x", "--d=-2"]
    assert join_negative_values(argv) == ["fit", "--model.lr=-inf", "--a=-1e-3", "--b", "--c", "x", "--d=-2"]


def _train(batch_size: int) -> tuple[dict[str, torch.Tensor], int]:
    dm = tiny_data((10,))
    dm.setup()
    m = tiny_model(MLP)
    m.bind_data(dm.input_shape, dm.num_classes)
    eng = FederatedEngine(
        m, dm, LocalSchedule(batch_size=batch_size, local_epochs=2), seed=1, vectorize="always"
    )
    groups = [Group(0, (1, 3), 2), Group(1, (0, 2, 4), 2)]
    return eng.train_groups(
        stack_params([eng.module_params()] * 2), groups, stage=1
    ).params, eng.schedule.batch_size


def test_a_batch_beyond_the_largest_client_is_cut_with_the_same_bits(capsys):
    largest = max(int(n) for n in (lambda d: (d.setup(), d.client_sizes)[1])(tiny_data((10,))))
    want, _ = _train(largest)
    capsys.readouterr()
    got, used = _train(1_000_000_000)  # sized by the batch, these buffers would need gigabytes
    assert used == largest
    assert f"batches are sized {largest}" in capsys.readouterr().err
    assert all(torch.equal(want[k], got[k]) for k in want)
