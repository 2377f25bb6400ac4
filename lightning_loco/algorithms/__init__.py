"""Outer-step maths: plain tensor code, no processes, no Lightning."""

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.algorithms.diloco import DiLoCo, DiLoCoState
from lightning_loco.algorithms.gasloc import GASLoC, GASLoCState
from lightning_loco.algorithms.noloco import NoLoCo, NoLoCoState

# Each algorithm's class by its strategy's name (``Trainer(strategy="noloco")``).
ALGORITHMS: dict[str, type[OuterAlgorithm]] = {"noloco": NoLoCo, "gasloc": GASLoC, "diloco": DiLoCo}

__all__ = ["ALGORITHMS", "DiLoCo", "DiLoCoState", "GASLoC", "GASLoCState", "NoLoCo", "NoLoCoState", "OuterAlgorithm",
           "OuterState"]
