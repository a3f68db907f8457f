from __future__ import annotations

import pytest
import torch

from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.errors import ConfigError, ContractError


class _UInt8Images(SyntheticDataModule):
    """Synthetic uint8 [N, 3, 4, 4] images with per-channel mean/std, to exercise transform."""

    mean = (0.5, 0.25, 0.125)
    std = (0.5, 0.25, 2.0)


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "label_split"])
def test_holdout_is_disjoint_and_within_the_client(partition):
    kwargs = dict(num_samples=600, num_test=50, num_clients=6, partition=partition, seed=3, min_client_size=5)
    plain = SyntheticDataModule(**kwargs)
    held = SyntheticDataModule(**kwargs, holdout_fraction=0.25)
    plain.setup()
    held.setup()
    for full, train, hold in zip(plain.client_indices, held.client_indices, held.holdout_indices):
        train_set, hold_set = set(train.tolist()), set(hold.tolist())
        assert not train_set & hold_set
        assert train_set | hold_set == set(full.tolist())  # the client's own data, nothing else
        assert len(hold) == min(max(round(len(full) * 0.25), 1), len(full) - 1)
    everything = torch.cat([*held.client_indices, *held.holdout_indices])
    assert sorted(everything.tolist()) == list(range(600))


def test_no_holdout_gives_empty_holdout_sets():
    dm = SyntheticDataModule(num_samples=100, num_clients=4, partition="iid")
    dm.setup()
    assert all(len(h) == 0 for h in dm.holdout_indices)
    assert sum(dm.client_sizes) == 100


def test_fingerprint_changes_with_the_seed_and_is_stable():
    def fp(seed, **kw):
        return SyntheticDataModule(
            num_samples=200, num_clients=4, partition="dirichlet", seed=seed, **kw
        ).fingerprint()

    assert fp(0) == fp(0)
    assert fp(0) != fp(1)
    assert fp(0) != fp(0, holdout_fraction=0.1)
    assert fp(0) != fp(0, noise=2.0)


def test_transform_handles_extra_leading_batch_dims():
    dm = _UInt8Images(
        num_samples=40, num_test=8, shape=(3, 4, 4), as_uint8=True, num_clients=2, partition="iid"
    )
    dm.setup()
    x = dm.train_x[:12]
    flat = dm.transform(x)
    mean = torch.tensor(dm.mean)[:, None, None]
    std = torch.tensor(dm.std)[:, None, None]
    torch.testing.assert_close(flat, (x.float() / 255 - mean) / std)
    batched = dm.transform(x.reshape(2, 3, 2, 3, 4, 4))
    assert batched.shape == (2, 3, 2, 3, 4, 4)
    torch.testing.assert_close(batched.reshape(12, 3, 4, 4), flat)
    # gather with index tensors of any shape returns the same normalised samples
    idx = torch.arange(12).reshape(3, 4)
    gx, gy = dm.gather(idx)
    assert gx.shape == (3, 4, 3, 4, 4) and gy.shape == (3, 4)
    torch.testing.assert_close(gx.reshape(12, 3, 4, 4), flat)
    assert gx.dtype == torch.float32 and dm.transform(x, torch.float64).dtype == torch.float64


def _formula(dm: _UInt8Images, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The normalisation written out on the raw samples at ``idx`` (independent of ``transform``)."""
    mean = torch.tensor(dm.mean, dtype=dtype)[:, None, None]
    std = torch.tensor(dm.std, dtype=dtype)[:, None, None]
    return (dm.train_x[idx].to(dtype) / 255.0 - mean) / std


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gather_from_the_normalised_copy_is_the_same_bits_and_follows_changes(dtype, monkeypatch):
    dm = _UInt8Images(
        num_samples=60, num_test=8, shape=(3, 4, 4), as_uint8=True, num_clients=3, partition="iid"
    )
    dm.setup()
    idx = torch.tensor([[5, 0, 59], [7, 7, 3]])
    assert torch.equal(dm.gather(idx, dtype)[0], _formula(dm, idx, dtype))
    assert dm._normalised(dtype) is dm._normalised(dtype)  # made once
    dm.train_x[5] = 255 - dm.train_x[5]  # modified in place: the copy is made again
    assert torch.equal(dm.gather(idx, dtype)[0], _formula(dm, idx, dtype))
    dm.train_x = dm.train_x.flip(0).contiguous()  # replaced
    assert torch.equal(dm.gather(idx, dtype)[0], _formula(dm, idx, dtype))
    monkeypatch.setattr("fedshard_lightning.data.base.NORMALISED_COPY_BYTES", 16)  # too large: per gather
    dm.train_x = dm.train_x.clone()
    assert dm._normalised(dtype) is None
    assert torch.equal(dm.gather(idx, dtype)[0], _formula(dm, idx, dtype))


def test_a_subclass_transform_runs_on_every_gather():
    class Flip(_UInt8Images):
        def transform(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1
            return super().transform(x, dtype).flip(-1)

    dm = Flip(num_samples=20, num_test=4, shape=(3, 4, 4), as_uint8=True, num_clients=2, partition="iid")
    dm.setup()
    idx = torch.tensor([1, 2])
    for _ in range(2):
        assert torch.equal(dm.gather(idx)[0], _formula(dm, idx, torch.float32).flip(-1))
    assert dm.calls == 2


@pytest.mark.parametrize("transformed", [False, True])
def test_gather_into_buffers_writes_the_formula_there(transformed):
    """``gather(..., out=)`` fills and returns the given buffers, from the normalised copy or through a transform."""

    class Flip(_UInt8Images):
        def transform(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return super().transform(x, dtype).flip(-1)

    cls = Flip if transformed else _UInt8Images
    dm = cls(num_samples=20, num_test=4, shape=(3, 4, 4), as_uint8=True, num_clients=2, partition="iid")
    dm.setup()
    idx = torch.tensor([[1, 2, 2], [19, 0, 5]])
    out = (torch.full((2, 3, 3, 4, 4), float("nan")), torch.full((2, 3), -1, dtype=dm.train_y.dtype))
    x, y = dm.gather(idx, torch.float32, out=out)
    assert x is out[0] and y is out[1]
    want = _formula(dm, idx, torch.float32)
    assert torch.equal(x, want.flip(-1) if transformed else want)
    assert torch.equal(y, dm.train_y[idx])


def test_float_data_without_mean_passes_through():
    dm = SyntheticDataModule(num_samples=30, num_test=5, num_clients=2, partition="iid")
    dm.setup()
    torch.testing.assert_close(dm.transform(dm.train_x[:3]), dm.train_x[:3])


def test_digits_and_basic_properties():
    dm = DigitsDataModule(num_clients=8, partition="dirichlet", rho=0.5)
    dm.setup()
    assert dm.input_shape == (1, 8, 8) and dm.num_classes == 10
    assert sum(dm.client_sizes) == len(dm.train_y)
    dm.setup()  # idempotent
    assert sum(dm.client_sizes) == len(dm.train_y)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_clients": 0}, "num_clients"),
        ({"partition": "shards"}, "partition"),
        ({"rho": 0.0}, "rho"),
        ({"min_client_size": 0}, "min_client_size"),
        ({"holdout_fraction": 1.0}, "holdout_fraction"),
    ],
)
def test_bad_settings_are_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SyntheticDataModule(**kwargs)


class _UserSplit(SyntheticDataModule):
    """A user's dataset whose ``load_split`` returns what ``broken`` makes of the right answer."""

    def __init__(self, broken, **kwargs) -> None:
        super().__init__(num_samples=40, num_test=10, num_clients=4, partition="iid", **kwargs)
        self.broken = broken

    def load_split(self, train):
        return self.broken(*super().load_split(train))


@pytest.mark.parametrize(
    ("broken", "match"),
    [
        (
            lambda x, y: (x.numpy(), y.numpy()),
            r"must return \(samples, labels\) as two torch tensors, got tuple of",
        ),
        (lambda x, y: x, r"must return \(samples, labels\) as two torch tensors, got Tensor"),
        (
            lambda x, y: (x, y[:-3]),
            r"returned samples of shape \(40, 64\) and labels of shape \(37,\); give one label",
        ),
        (lambda x, y: (x, y[:, None]), r"returned samples of shape \(40, 64\) and labels of shape \(40, 1\)"),
        (lambda x, y: (x, y.double() + 0.5), r"returned labels that are not whole numbers"),
        (lambda x, y: (x, y - 1), r"returned a negative label \(-1\)"),
    ],
)
def test_a_broken_load_split_is_one_line_naming_it(broken, match):
    """These had ended in a traceback (numpy) or trained on mismatched samples and labels."""
    with pytest.raises(ContractError, match=r"^data: _UserSplit\.load_split\(train=True\) " + match):
        _UserSplit(broken).setup()


def test_whole_float_labels_still_work():
    dm = _UserSplit(lambda x, y: (x, y.float()))
    ref = _UserSplit(lambda x, y: (x, y))
    dm.setup()
    ref.setup()
    assert torch.equal(dm.train_y, ref.train_y) and dm.train_y.dtype == torch.long


def test_a_dataset_without_load_split_is_one_line():
    from fedshard_lightning.data.base import FederatedDataModule

    class NoSplit(FederatedDataModule):
        pass

    with pytest.raises(ContractError, match=r"^data: NoSplit must implement load_split\(train\)"):
        NoSplit(num_clients=2).setup()
