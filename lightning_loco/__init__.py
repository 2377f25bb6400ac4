"""Low-communication data-parallel training for any PyTorch Lightning model.

Importing the package registers the strategy names ``"noloco"`` and ``"diloco"`` with Lightning's
``StrategyRegistry`` (idempotently: launchers re-import the package in every process).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_loco.algorithms import DiLoCo, NoLoCo
from lightning_loco.strategies import DiLoCoStrategy, NoLoCoStrategy, OuterStepReport, OuterStepStrategy

__version__ = "0.1.0"

for _strategy in (NoLoCoStrategy, DiLoCoStrategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = ["DiLoCo", "DiLoCoStrategy", "NoLoCo", "NoLoCoStrategy", "OuterStepReport", "OuterStepStrategy"]
