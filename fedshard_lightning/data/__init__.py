"""Federated datamodules: one file per dataset on the FederatedDataModule base."""

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.data.digits import DigitsDataModule
from fedshard_lightning.data.synthetic import SyntheticDataModule

__all__ = ["DigitsDataModule", "FederatedDataModule", "SyntheticDataModule"]
