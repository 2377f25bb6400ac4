"""Lightning glue: the ``Strategy`` classes users pass to ``Trainer``."""

from lightning_loco.driver.reports import OuterStepReport
from lightning_loco.trainer.base import OuterStepStrategy
from lightning_loco.trainer.diloco import DiLoCoStrategy
from lightning_loco.trainer.gasloc import GASLoCStrategy
from lightning_loco.trainer.noloco import NoLoCoStrategy

__all__ = ["DiLoCoStrategy", "GASLoCStrategy", "NoLoCoStrategy", "OuterStepReport", "OuterStepStrategy"]
