"""Lightning glue: the ``Strategy`` classes users pass to ``Trainer``."""

from lightning_loco.reports import OuterStepReport
from lightning_loco.strategies.base import OuterStepStrategy
from lightning_loco.strategies.diloco import DiLoCoStrategy
from lightning_loco.strategies.gasloc import GASLoCStrategy
from lightning_loco.strategies.noloco import NoLoCoStrategy

__all__ = ["DiLoCoStrategy", "GASLoCStrategy", "NoLoCoStrategy", "OuterStepReport", "OuterStepStrategy"]
