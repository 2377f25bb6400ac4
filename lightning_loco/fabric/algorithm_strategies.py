"""The strategies for a Fabric loop, one per algorithm: each takes the same arguments as the Trainer's strategy of
its name (built and checked by :mod:`lightning_loco.algorithms.arguments`), then ``max_steps`` and the options
every strategy shares (``**kwargs``, see :class:`~lightning_loco.fabric.strategy.FabricOuterStepStrategy`)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_loco.algorithms.arguments import (
    DILOCO_TEXT,
    GASLOC_TEXT,
    NOLOCO_TEXT,
    build_diloco,
    build_gasloc,
    build_noloco,
)
from lightning_loco.algorithms.defaults import DILOCO, GASLOC, NOLOCO
from lightning_loco.algorithms.outer_optimizer import OuterOptimizerFactory
from lightning_loco.fabric.strategy import FabricOuterStepStrategy


class NoLoCoFabricStrategy(FabricOuterStepStrategy):
    __doc__ = NOLOCO_TEXT.doc
    strategy_name = NOLOCO_TEXT.name
    description = NOLOCO_TEXT.description

    def __init__(
        self,
        sync_every: int = NOLOCO.sync_every,
        outer_lr: float = NOLOCO.outer_lr,
        outer_momentum: float = NOLOCO.outer_momentum,
        averaging_rate: Optional[float] = NOLOCO.averaging_rate,
        group_size: int = NOLOCO.group_size,
        seed: int = NOLOCO.seed,
        **kwargs: Any,
    ) -> None:
        algorithm = build_noloco(outer_lr=outer_lr, outer_momentum=outer_momentum, averaging_rate=averaging_rate,
                                 group_size=group_size, seed=seed, warn=rank_zero_warn)
        super().__init__(algorithm, sync_every, **kwargs)


class GASLoCFabricStrategy(FabricOuterStepStrategy):
    __doc__ = GASLOC_TEXT.doc
    strategy_name = GASLOC_TEXT.name
    description = GASLOC_TEXT.description

    def __init__(
        self,
        sync_every: int = GASLOC.sync_every,
        outer_lr: float = GASLOC.outer_lr,
        outer_momentum: float = GASLOC.outer_momentum,
        gossip_step: float = GASLOC.gossip_step,
        topology: Literal["random_pairs", "ring", "exponential", "complete"] = GASLOC.topology,
        seed: int = GASLOC.seed,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        momentum_on: Literal["mixed", "sent"] = GASLOC.momentum_on,
        **kwargs: Any,
    ) -> None:
        algorithm = build_gasloc(outer_lr=outer_lr, outer_momentum=outer_momentum, gossip_step=gossip_step,
                                 topology=topology, seed=seed, outer_optimizer=outer_optimizer,
                                 momentum_on=momentum_on, warn=rank_zero_warn)
        super().__init__(algorithm, sync_every, **kwargs)


class DiLoCoFabricStrategy(FabricOuterStepStrategy):
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
