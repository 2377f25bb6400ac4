"""The outer-step strategies for Lightning Fabric (docs/fabric.md).

``import lightning_loco`` registers ``"noloco"``, ``"gasloc"`` and ``"diloco"`` with Fabric's strategy registry too,
so ``L.Fabric(strategy="noloco", devices=4)`` runs NoLoCo's outer step inside a Fabric loop's ``optimizer.step()``;
the classes below take the same arguments as the Trainer's strategies of the same names, and ``max_steps``.
"""

from lightning_loco.fabric.strategy import FabricOuterStepStrategy
from lightning_loco.trainer.diloco import DiLoCoArguments, DiLoCoStrategy
from lightning_loco.trainer.gasloc import GASLoCArguments, GASLoCStrategy
from lightning_loco.trainer.noloco import NoLoCoArguments, NoLoCoStrategy


class NoLoCoFabricStrategy(NoLoCoArguments, FabricOuterStepStrategy):
    __doc__ = NoLoCoStrategy.__doc__
    strategy_name = NoLoCoStrategy.strategy_name
    description = NoLoCoStrategy.description


class GASLoCFabricStrategy(GASLoCArguments, FabricOuterStepStrategy):
    __doc__ = GASLoCStrategy.__doc__
    strategy_name = GASLoCStrategy.strategy_name
    description = GASLoCStrategy.description


class DiLoCoFabricStrategy(DiLoCoArguments, FabricOuterStepStrategy):
    __doc__ = DiLoCoStrategy.__doc__
    strategy_name = DiLoCoStrategy.strategy_name
    description = DiLoCoStrategy.description


__all__ = ["DiLoCoFabricStrategy", "FabricOuterStepStrategy", "GASLoCFabricStrategy", "NoLoCoFabricStrategy"]
