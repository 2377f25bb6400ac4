"""``DiLoCoStrategy``: the baseline; every H inner steps one all-reduce of the pseudo-gradients."""

from __future__ import annotations

from typing import Any, Optional

from lightning_loco.algorithms.defaults import DILOCO
from lightning_loco.algorithms.diloco import DiLoCo, OuterOptimizerFactory
from lightning_loco.trainer.base import OuterStepStrategy


class DiLoCoArguments:
    """DiLoCo's own arguments, for the Trainer's strategy and Fabric's alike (see :class:`DiLoCoStrategy`)."""

    def __init__(
        self,
        sync_every: int = DILOCO.sync_every,
        outer_lr: float = DILOCO.outer_lr,
        outer_momentum: float = DILOCO.outer_momentum,
        nesterov: bool = DILOCO.nesterov,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        **kwargs: Any,
    ) -> None:
        algorithm = DiLoCo(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                           outer_optimizer=outer_optimizer)
        super().__init__(algorithm, sync_every, **kwargs)  # type: ignore[call-arg]


class DiLoCoStrategy(DiLoCoArguments, OuterStepStrategy):
    """DiLoCo (Douillard et al., arXiv 2311.08105): the all-reduce baseline.

    Every ``sync_every`` inner optimizer steps the replicas all-reduce their pseudo-gradients
    Δ = θ − φ, the outer optimizer steps the shared anchor φ with gradient −mean Δ, and every replica
    restarts from φ.

    Args:
        sync_every: H, inner optimizer steps between outer steps (paper: 500).
        outer_lr: learning rate of the default outer SGD (paper: 0.7).
        outer_momentum: momentum of the default outer SGD (paper: 0.9).
        nesterov: Nesterov momentum for the default outer SGD (paper: True).
        outer_optimizer: any torch optimizer over the anchor in place of that SGD, e.g.
            ``functools.partial(torch.optim.Adam, lr=1e-3)`` (YAML: ``{class_path: torch.optim.Adam}``).
        **kwargs: the options every strategy shares: see ``OuterStepStrategy`` and docs/options.md.
    """

    strategy_name = "diloco"
    description = "DiLoCo: H local steps, then an all-reduce of pseudo-gradients and an outer optimizer step"
