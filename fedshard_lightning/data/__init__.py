"""Federated datamodules: one file per dataset on the FederatedDataModule base."""

from fedshard_lightning.data.adult import AdultDataModule
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.data.cifar10 import CIFAR10DataModule
from fedshard_lightning.data.cifar100 import CIFAR100DataModule
from fedshard_lightning.data.digits import DigitsDataModule
from fedshard_lightning.data.download import RemoteFile
from fedshard_lightning.data.emnist import EMNISTDataModule
from fedshard_lightning.data.fmnist import FashionMNISTDataModule
from fedshard_lightning.data.mnist import MNISTDataModule
from fedshard_lightning.data.purchase import Purchase100DataModule
from fedshard_lightning.data.svhn import SVHNDataModule
from fedshard_lightning.data.synthetic import SyntheticDataModule

__all__ = [
    "AdultDataModule",
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "DigitsDataModule",
    "EMNISTDataModule",
    "FashionMNISTDataModule",
    "FederatedDataModule",
    "MNISTDataModule",
    "Purchase100DataModule",
    "RemoteFile",
    "SVHNDataModule",
    "SyntheticDataModule",
]
