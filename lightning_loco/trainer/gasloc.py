"""``GASLoCStrategy``: gossip over sparse matchings, with the outer momentum as gossip acceleration."""

from __future__ import annotations

from typing import Any, Literal, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_loco.algorithms.arguments import GASLOC_TEXT, build_gasloc
from lightning_loco.algorithms.defaults import GASLOC
from lightning_loco.algorithms.outer_optimizer import OuterOptimizerFactory
from lightning_loco.trainer.base import OuterStepStrategy


class GASLoCStrategy(OuterStepStrategy):
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
