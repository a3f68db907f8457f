"""File-backed datasets: where the files live, fetching them on request, and the missing-files error.

A dataset read from files (MNIST, Fashion-MNIST, EMNIST, CIFAR-10/100, SVHN, Adult, Purchase-100)
subclasses :class:`FileDataModule`, names its files (:attr:`FileDataModule.resources`, each with
its published checksum) and implements :meth:`FileDataModule.read_split`. The base supplies the
rest that every such dataset would otherwise repeat: ``<data_dir>/<folder>``, ``prepare_data`` fetching
and unpacking verified files when ``download: true``, downloading from ``setup`` as well when a
Fabric loop never called ``prepare_data``, the one-line error for absent files, and reading both
splits once for datasets whose test encoding depends on the training split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

from torch import Tensor

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.data.download import (
    MissingFilesError,
    RemoteFile,
    fetch,
    find_first,
    load_or_download,
    missing_files_error,
)

__all__ = ["FileDataModule"]

Split = tuple[Tensor, Tensor]


class FileDataModule(FederatedDataModule):
    """A :class:`FederatedDataModule` read from files under ``<data_dir>/<folder>``."""

    #: Name used in messages.
    dataset_name: ClassVar[str] = "dataset"
    #: Sub-folder of ``data_dir`` holding the files.
    folder: ClassVar[str] = ""
    #: Where to get the files by hand (named in the missing-files error).
    source: ClassVar[str] = ""
    #: Files fetched by ``download: true``, with their published checksums.
    resources: ClassVar[tuple[RemoteFile, ...]] = ()

    @property
    def root(self) -> Path:
        """Folder holding this dataset's files."""
        return Path(self.data_dir) / self.folder

    # -- what subclasses provide --------------------------------------------------------------
    def read_split(self, train: bool) -> Split:
        """Read one split from the files; raise :meth:`missing` when they are absent."""
        raise NotImplementedError(f"{type(self).__name__} must implement read_split(train)")

    def remote_files(self) -> tuple[RemoteFile, ...]:
        """Files to fetch (default :attr:`resources`)."""
        return self.resources

    def present(self) -> bool:
        """Whether the data is there already, so ``prepare_data`` need not fetch (default: never)."""
        return False

    def unpack(self, path: Path) -> None:
        """Called with every fetched file (archives extract themselves here)."""

    # -- shared -------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Fetch and verify (and unpack) the files when ``download`` is set; otherwise do nothing."""
        if not self.download or self.present():
            return
        for file in self.remote_files():
            self.unpack(fetch(file, self.root))

    def load_split(self, train: bool) -> Split:
        """:meth:`read_split`, downloading first when files are missing and ``download`` is set."""
        return load_or_download(self, self.read_split, train)

    def missing(self, expected: Sequence[str] | None = None) -> MissingFilesError:
        """The one-line error for absent files (default: every resource's name)."""
        names = list(expected) if expected is not None else [f.name for f in self.resources]
        return missing_files_error(self.dataset_name, self.root, names, self.source)

    def locate(self, name: str) -> Path:
        """``root/name``, or the same without ``.gz``; :meth:`missing` when neither exists."""
        path = find_first(self.root, (name, name.removesuffix(".gz")))
        if path is None:
            raise self.missing()
        return path

    def split_of_both(self, train: bool, read_both: Callable[[], tuple[Split, Split]]) -> Split:
        """One split of a dataset read (and encoded) in one go; the other is kept for the next call."""
        pending = getattr(self, "_pending_test", None)
        if not train and pending is not None:
            self._pending_test = None
            return pending
        train_split, test_split = read_both()
        if train:
            self._pending_test = test_split  # handed out (and dropped) by the next read of the test split
            return train_split
        return test_split
