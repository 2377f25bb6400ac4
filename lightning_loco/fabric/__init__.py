"""The outer-step strategies for Lightning Fabric (docs/fabric.md).

``import lightning_loco`` registers ``"noloco"``, ``"gasloc"`` and ``"diloco"`` with Fabric's strategy registry too,
so ``L.Fabric(strategy="noloco", devices=4)`` runs NoLoCo's outer step inside a Fabric loop's ``optimizer.step()``;
the classes below take the same arguments as the Trainer's strategies of the same names, and ``max_steps``.
"""

from lightning_loco.fabric.algorithm_strategies import DiLoCoFabricStrategy, GASLoCFabricStrategy, NoLoCoFabricStrategy
from lightning_loco.fabric.strategy import FabricOuterStepStrategy

__all__ = ["DiLoCoFabricStrategy", "FabricOuterStepStrategy", "GASLoCFabricStrategy", "NoLoCoFabricStrategy"]
