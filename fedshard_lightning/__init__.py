"""FedShard on Lightning Fabric: vectorized federated learning with exact, fair, fast unlearning."""

from fedshard_lightning.module import FederatedModule
from fedshard_lightning.trainer import FederatedTrainer

__all__ = ["FederatedModule", "FederatedTrainer"]
__version__ = "0.1.0"
