"""Low-communication data-parallel training for any PyTorch Lightning model.

Importing the package registers the strategy names ``"noloco"``, ``"diloco"`` and ``"gasloc"`` with Lightning's
``StrategyRegistry`` (idempotently: launchers re-import the package in every process).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.batchnorm_update import BatchNormUpdate
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.options import FSDPConfig, PacingConfig, WireConfig
from lightning_loco.outer_checkpoint import OuterStepCheckpoint
from lightning_loco.short_runs import ShortRunWarning
from lightning_loco.strategies import (
    DiLoCoStrategy,
    GASLoCStrategy,
    NoLoCoStrategy,
    OuterStepReport,
    OuterStepStrategy,
)
from lightning_loco.transport import PeerError

__version__ = "0.1.0"

for _strategy in (NoLoCoStrategy, DiLoCoStrategy, GASLoCStrategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "BatchNormUpdate",
    "DiLoCo",
    "DiLoCoStrategy",
    "ElasticConfig",
    "FSDPConfig",
    "GASLoC",
    "GASLoCStrategy",
    "NoLoCo",
    "NoLoCoStrategy",
    "OuterStepCheckpoint",
    "OuterStepReport",
    "OuterStepStrategy",
    "PacingConfig",
    "PeerError",
    "ShortRunWarning",
    "WireConfig",
]
