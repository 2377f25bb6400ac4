"""``NoLoCoStrategy``: after every H inner steps each replica partially averages with one random peer."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_loco.algorithms.arguments import NOLOCO_TEXT, build_noloco, noloco_group_note
from lightning_loco.algorithms.defaults import NOLOCO
from lightning_loco.algorithms.noloco import NoLoCo
from lightning_loco.trainer.base import OuterStepStrategy


class NoLoCoStrategy(OuterStepStrategy):
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

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert isinstance(self.algorithm, NoLoCo)
        note = noloco_group_note(self.algorithm.group_size, self.num_replicas)
        if note is not None:
            rank_zero_warn(note)
