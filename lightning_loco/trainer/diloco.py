"""``DiLoCoStrategy``: the baseline; every H inner steps one all-reduce of the pseudo-gradients."""

from __future__ import annotations

from typing import Any, Optional

from lightning_loco.algorithms.arguments import DILOCO_TEXT, build_diloco
from lightning_loco.algorithms.defaults import DILOCO
from lightning_loco.algorithms.diloco import OuterOptimizerFactory
from lightning_loco.trainer.base import OuterStepStrategy


class DiLoCoStrategy(OuterStepStrategy):
    __doc__ = DILOCO_TEXT.doc
    strategy_name = DILOCO_TEXT.name
    description = DILOCO_TEXT.description

    def __init__(
        self,
        sync_every: int = DILOCO.sync_every,
        outer_lr: float = DILOCO.outer_lr,
        outer_momentum: float = DILOCO.outer_momentum,
        nesterov: bool = DILOCO.nesterov,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        **kwargs: Any,
    ) -> None:
        algorithm = build_diloco(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                                 outer_optimizer=outer_optimizer)
        super().__init__(algorithm, sync_every, **kwargs)
