"""FedShard on Lightning Fabric: vectorized federated learning with exact, fair, fast unlearning.

The public names are imported on first use (PEP 562), so ``python -m fedshard_lightning`` can
answer a Ctrl-C during the seconds that torch and Lightning take to import with one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedshard_lightning.module import FederatedModule
    from fedshard_lightning.run.checkpoint import load_model
    from fedshard_lightning.trainer.trainer import FederatedTrainer

__all__ = ["FederatedModule", "FederatedTrainer", "load_model"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "FederatedModule":
        from fedshard_lightning.module import FederatedModule

        return FederatedModule
    if name == "FederatedTrainer":
        from fedshard_lightning.trainer.trainer import FederatedTrainer

        return FederatedTrainer
    if name == "load_model":
        from fedshard_lightning.run.checkpoint import load_model

        return load_model
    raise AttributeError(f"module 'fedshard_lightning' has no attribute {name!r}")
