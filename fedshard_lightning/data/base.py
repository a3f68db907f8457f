"""The federated datamodule: one training tensor, a client partition of its indices, a test set.

Data lives on the compute device as one tensor in its native storage type (uint8 for images), and
batches for many clients are gathered by index at once (``gather``), so K clients never cost K
float copies of the data. Subclasses only say how to read their files (``load_split``) and, for
downloads, what to fetch (``prepare_data``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Literal

import lightning as L
import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.data.partition import dirichlet_partition, iid_partition, label_split_partition
from fedshard_lightning.errors import ConfigError, ContractError
from fedshard_lightning.init_args import RecordsInitArgs, init_args

__all__ = ["FederatedDataModule"]

Partition = Literal["iid", "dirichlet", "label_split"]


LOCATION_ARGS = frozenset({"data_dir", "download"})
"""Constructor arguments that change where files come from, never what they hold."""

NORMALISED_COPY_BYTES = 256 << 20
"""Largest normalised copy of a training set kept for :meth:`FederatedDataModule.gather`."""


class FederatedDataModule(RecordsInitArgs, L.LightningDataModule):
    """Base class of every dataset: partition into clients, normalise on gather.

    Subclasses implement :meth:`load_split` and may set ``mean``/``std`` (per channel for images,
    per feature or scalar for vectors) and override :meth:`prepare_data` to download.

    Args:
        num_clients: Number of clients K.
        partition: ``iid``, ``dirichlet`` (NIID-Bench label-dir with concentration ``rho``) or
            ``label_split`` (two client groups on disjoint halves of the labels).
        rho: Dirichlet concentration; smaller is more skewed.
        min_client_size: ``dirichlet`` only: redrawn until every client holds at least this
            many samples, counted before ``holdout_fraction`` takes its share; ``iid`` and
            ``label_split`` give near-equal parts and only guarantee one sample per client.
        label_split_fraction: Share of clients in the first group of ``label_split``.
        holdout_fraction: Share of each client's samples kept out of training as its own held-out
            set (per-client accuracy for the fairness metrics); 0 disables it.
        seed: Seed of the partition and of the held-out split, and of whatever else a dataset
            draws (the digits and Purchase-100 train/test split, the synthetic samples);
            independent of ``seed_everything``, which seeds the model and the training.
        data_dir: Folder that holds (or receives) the dataset files.
        download: Fetch missing files in ``prepare_data``.
    """

    mean: Sequence[float] | float | None = None
    std: Sequence[float] | float | None = None

    def __init__(
        self,
        num_clients: int = 32,
        partition: Partition = "dirichlet",
        rho: float = 0.5,
        min_client_size: int = 10,
        label_split_fraction: float = 0.75,
        holdout_fraction: float = 0.0,
        seed: int = 0,
        data_dir: str = "data",
        download: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(num_clients, int) or num_clients < 1:
            raise ConfigError(f"data.num_clients={num_clients!r}: must be a positive integer")
        if partition not in ("iid", "dirichlet", "label_split"):
            raise ConfigError(f"data.partition={partition!r}: choose one of iid, dirichlet, label_split")
        if partition == "dirichlet" and not 0 < rho < math.inf:
            raise ConfigError(
                f"data.rho={rho}: the Dirichlet concentration must be finite and > 0 (e.g. 0.1 or 0.5)"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ConfigError(f"data.seed={seed!r}: the partition seed must be an integer in [0, 2**32)")
        if min_client_size < 1:
            raise ConfigError(f"data.min_client_size={min_client_size}: must be >= 1")
        if not 0 <= holdout_fraction < 1:
            raise ConfigError(f"data.holdout_fraction={holdout_fraction}: must be in [0, 1)")
        self.num_clients = num_clients
        self.partition = partition
        self.rho = rho
        self.min_client_size = min_client_size
        self.label_split_fraction = label_split_fraction
        self.holdout_fraction = holdout_fraction
        self.seed = seed
        self.data_dir = data_dir
        self.download = download
        self._ready = False
        self.train_x: Tensor
        self.train_y: Tensor
        self.test_x: Tensor
        self.test_y: Tensor
        self.client_indices: list[Tensor] = []
        self.holdout_indices: list[Tensor] = []

    # -- what subclasses provide -------------------------------------------------------------
    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Return the raw samples (native dtype, e.g. uint8 [N, C, H, W]) and int64 labels [N]."""
        raise ContractError(
            f"data: {type(self).__name__} must implement load_split(train) (docs/extending.md)"
        )

    def hparams_for_fingerprint(self) -> dict:
        """The constructor arguments (recorded, never listed by hand) except where files live.

        ``data_dir`` and ``download`` (:data:`LOCATION_ARGS`) only say where the samples come
        from; :meth:`fingerprint` hashes the samples' labels and the partition themselves.
        """
        args = init_args(self)
        return {
            "class": args["class_path"],
            **{k: v for k, v in args["init_args"].items() if k not in LOCATION_ARGS},
        }

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        """Load both splits and draw the client partition (idempotent)."""
        if self._ready:
            return
        train_x, train_y = self._checked_split(train=True)
        test_x, test_y = self._checked_split(train=False)
        self.train_x, self.train_y = train_x, train_y.long()
        self.test_x, self.test_y = test_x, test_y.long()
        rng = np.random.default_rng(self.seed)
        labels = self.train_y.cpu().numpy()
        if self.partition == "iid":
            parts = iid_partition(len(labels), self.num_clients, rng)
        elif self.partition == "dirichlet":
            parts = dirichlet_partition(labels, self.num_clients, self.rho, self.min_client_size, rng)
        else:
            parts = label_split_partition(labels, self.num_clients, self.label_split_fraction, rng)
        train_parts, holdout_parts = [], []
        for part in parts:
            if self.holdout_fraction > 0 and len(part) > 1:
                shuffled = rng.permutation(part)
                n_hold = min(max(round(len(part) * self.holdout_fraction), 1), len(part) - 1)
                holdout_parts.append(np.sort(shuffled[:n_hold]))
                train_parts.append(np.sort(shuffled[n_hold:]))
            else:
                train_parts.append(part)
                holdout_parts.append(part[:0])
        self.client_indices = [torch.as_tensor(p, dtype=torch.long) for p in train_parts]
        self.holdout_indices = [torch.as_tensor(p, dtype=torch.long) for p in holdout_parts]
        self._ready = True

    def _checked_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """``load_split``'s samples and labels, refused in one line unless one integer label per sample.

        A user's dataset that returned numpy arrays had ended in a traceback, and one that
        returned fewer labels than samples had trained on what it was given.
        """
        out = self.load_split(train=train)
        where = f"data: {type(self).__name__}.load_split(train={train})"
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
            got = type(out).__name__ + (
                f" of {[type(t).__name__ for t in out]}" if isinstance(out, (tuple, list)) else ""
            )
            raise ContractError(f"{where} must return (samples, labels) as two torch tensors, got {got}")
        x, y = out
        if y.ndim != 1 or x.ndim < 1 or len(x) != len(y):
            raise ContractError(
                f"{where} returned samples of shape {tuple(x.shape)} and labels of shape {tuple(y.shape)}; "
                "give one label per sample (labels of shape [N])"
            )
        if (y.is_floating_point() and not bool(torch.equal(y, y.round()))) or y.is_complex():
            raise ContractError(f"{where} returned labels that are not whole numbers; give integer class ids")
        if len(y) and int(y.min()) < 0:
            raise ContractError(f"{where} returned a negative label ({int(y.min())}); give class ids 0..C-1")
        return x, y

    def to(self, device: torch.device | str) -> FederatedDataModule:
        """Move the data tensors (not copies per client) to ``device``."""
        self.setup()
        self.train_x, self.train_y = self.train_x.to(device), self.train_y.to(device)
        self.test_x, self.test_y = self.test_x.to(device), self.test_y.to(device)
        return self

    # -- access ------------------------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        """Number of distinct labels over both splits."""
        self.setup()
        return int(max(int(self.train_y.max()), int(self.test_y.max())) + 1)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample."""
        self.setup()
        return tuple(self.train_x.shape[1:])

    @property
    def client_sizes(self) -> list[int]:
        """Training samples per client."""
        self.setup()
        return [len(i) for i in self.client_indices]

    def transform(self, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Convert raw samples to normalised floats; works on any leading batch dimensions."""
        scale = 255.0 if x.dtype == torch.uint8 else 1.0
        out = x.to(dtype)
        if scale != 1.0:
            out = out / scale
        if self.mean is not None:
            mean, std = self._norm_tensors(dtype, x.device)
            out = (out - mean) / std
        return out

    def _norm_tensors(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """Mean and std as tensors, made once per dtype and device (no host copy per training step)."""
        cache = self.__dict__.setdefault("_norm_cache", {})
        key = (dtype, str(device), repr(self.mean), repr(self.std))
        if key not in cache:
            mean = torch.as_tensor(self.mean, dtype=dtype, device=device)
            std = torch.as_tensor(self.std if self.std is not None else 1.0, dtype=dtype, device=device)
            if mean.ndim == 1 and len(self.train_x.shape) - 1 == 3:  # per-channel on [.., C, H, W]
                mean, std = mean[:, None, None], std[:, None, None]
            cache[key] = (mean, std)
        return cache[key]

    def gather(
        self, indices: Tensor, dtype: torch.dtype = torch.float32, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Training samples and labels at ``indices`` (any shape), normalised.

        The engine gathers every local step, so a training set whose normalised copy fits in
        :data:`NORMALISED_COPY_BYTES` is normalised once and indexed afterwards: the same
        element-wise operators on the same values, hence the same bits, with one operator per
        step instead of three or four. A subclass that overrides :meth:`transform` (augmentation,
        say) is transformed per step as before.

        Args:
            indices: Global training-sample indices.
            dtype: The samples' dtype.
            out: Contiguous (samples, labels) buffers of the results' shapes to write into and
                return, so that a caller that gathers every round can keep views of them.
        """
        own = self._normalised(dtype)
        flat = indices.reshape(-1)  # index_select: about half the time of advanced indexing
        if out is None:
            y = self.train_y.index_select(0, flat).view(indices.shape)
        else:
            x_out, y = out
            torch.index_select(self.train_y, 0, flat, out=y.view(-1))
        if own is not None:
            if out is None:
                return own.index_select(0, flat).view(*indices.shape, *own.shape[1:]), y
            torch.index_select(own, 0, flat, out=x_out.view(-1, *own.shape[1:]))
            return x_out, y
        x = self.transform(
            self.train_x.index_select(0, flat).view(*indices.shape, *self.train_x.shape[1:]), dtype
        )
        return (x, y) if out is None else (x_out.copy_(x), y)

    def _normalised(self, dtype: torch.dtype) -> Tensor | None:
        """The whole training set normalised, kept while ``train_x`` is the same unmodified tensor."""
        x, got = self.train_x, self.__dict__.get("_normalised_copy")
        key = (dtype, self.mean, self.std)
        if got is not None and got[0] is x and got[1] == x._version and got[2] == key:
            return got[3]
        if type(self).transform is not FederatedDataModule.transform:
            return None
        if x.numel() * dtype.itemsize > NORMALISED_COPY_BYTES:
            return None
        self.__dict__["_normalised_copy"] = (x, x._version, key, self.transform(x, dtype))
        return self.__dict__["_normalised_copy"][3]

    def test_data(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """The whole test set, normalised."""
        self.setup()
        return self.transform(self.test_x, dtype), self.test_y

    def fingerprint(self) -> str:
        """Hash of the settings, the labels and the partition: a cache made on other data is refused."""
        self.setup()
        h = hashlib.sha256(json.dumps(self.hparams_for_fingerprint(), sort_keys=True).encode())
        h.update(self.train_y.cpu().numpy().astype(np.int64).tobytes())
        h.update(np.asarray(self.train_x.shape, dtype=np.int64).tobytes())
        for part in self.client_indices:
            h.update(part.cpu().numpy().astype(np.int64).tobytes())
            h.update(b"|")
        return h.hexdigest()[:32]
