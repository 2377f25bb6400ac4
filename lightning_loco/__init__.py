"""Low-communication data-parallel training for any PyTorch Lightning model.

Importing the package registers the strategy names ``"noloco"``, ``"diloco"`` and ``"gasloc"`` with Lightning's
``StrategyRegistry`` for the Trainer and with Fabric's ``STRATEGY_REGISTRY`` (idempotently: launchers re-import the
package in every process).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.fabric import (
    DiLoCoFabricStrategy,
    FabricOuterStepStrategy,
    GASLoCFabricStrategy,
    NoLoCoFabricStrategy,
)
from lightning_loco.replica.options import FSDPConfig, PacingConfig, WireConfig
from lightning_loco.replica.short_runs import ShortRunWarning
from lightning_loco.trainer import (
    DiLoCoStrategy,
    GASLoCStrategy,
    NoLoCoStrategy,
    OuterStepReport,
    OuterStepStrategy,
)
from lightning_loco.trainer.batchnorm_update import BatchNormUpdate
from lightning_loco.trainer.outer_checkpoint import OuterStepCheckpoint
from lightning_loco.trainer.validation import ReplicaValidation
from lightning_loco.trainer.verify import VerifyState
from lightning_loco.transport import PeerError

__version__ = "0.1.0"

for _strategy in (NoLoCoStrategy, DiLoCoStrategy, GASLoCStrategy):
    _strategy.register_strategies(StrategyRegistry)
for _fabric_strategy in (NoLoCoFabricStrategy, DiLoCoFabricStrategy, GASLoCFabricStrategy):
    _fabric_strategy.register_strategies(STRATEGY_REGISTRY)

__all__ = [
    "BatchNormUpdate",
    "DiLoCo",
    "DiLoCoFabricStrategy",
    "DiLoCoStrategy",
    "ElasticConfig",
    "FSDPConfig",
    "FabricOuterStepStrategy",
    "GASLoC",
    "GASLoCFabricStrategy",
    "GASLoCStrategy",
    "NoLoCo",
    "NoLoCoFabricStrategy",
    "NoLoCoStrategy",
    "OuterStepCheckpoint",
    "OuterStepReport",
    "OuterStepStrategy",
    "PacingConfig",
    "PeerError",
    "ReplicaValidation",
    "ShortRunWarning",
    "VerifyState",
    "WireConfig",
]
