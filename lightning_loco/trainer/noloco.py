"""``NoLoCoStrategy``: after every H inner steps each replica partially averages with one random peer."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_loco.algorithms.defaults import NOLOCO
from lightning_loco.algorithms.noloco import NoLoCo, stability_interval
from lightning_loco.trainer.base import OuterStepStrategy


class NoLoCoArguments:
    """NoLoCo's own arguments, for the Trainer's strategy and Fabric's alike (see :class:`NoLoCoStrategy`)."""

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
        algorithm = NoLoCo(outer_lr=outer_lr, outer_momentum=outer_momentum, averaging_rate=averaging_rate,
                           group_size=group_size, seed=seed)
        low, high = stability_interval(algorithm.outer_momentum)
        if not low < algorithm.averaging_rate < high:
            rank_zero_warn(
                f"NoLoCo's averaging_rate γ={algorithm.averaging_rate} is outside the stability interval "
                f"α < γ < √(2 + α²) = ({low:.3g}, {high:.3g}) for outer_momentum α={algorithm.outer_momentum}; "
                "replicas may drift apart. Use averaging_rate=None (γ = outer_lr) or a value inside it."
            )
        super().__init__(algorithm, sync_every, **kwargs)  # type: ignore[call-arg]


class NoLoCoStrategy(NoLoCoArguments, OuterStepStrategy):
    """NoLoCo (Kolehmainen et al., arXiv 2506.10911): no collective at all while training.

    Every ``sync_every`` inner optimizer steps the replicas split into random groups of
    ``group_size`` (drawn from ``seed`` and the outer-step index, identical on every rank with no
    message) and each replica updates its own anchor φ and momentum δ::

        δ ← α·δ + β·(mean θ_G − mean φ_G) − γ·(φ − mean φ_G);   φ ← φ + δ;   θ ← φ

    With γ = β (the default) only live weights travel: one model copy each way per outer step.

    Args:
        sync_every: H, inner optimizer steps between outer steps (paper: 50).
        outer_lr: β, the outer learning rate (paper: 0.7).
        outer_momentum: α, the outer momentum (paper: 0.5).
        averaging_rate: γ, the pull towards the group's mean anchor (None: γ = β, as the reference code).
        group_size: n, replicas per group (paper: 2; the last group takes a remainder).
        seed: seeds the random groups (with the outer-step index), not the global RNG.
        **kwargs: the options every strategy shares: see ``OuterStepStrategy`` and docs/options.md.
    """

    strategy_name = "noloco"
    description = "NoLoCo: H local steps, then partial averaging with one random peer (no collective)"

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert isinstance(self.algorithm, NoLoCo)
        n, size = self.algorithm.group_size, self.num_replicas
        if 1 < size < n:
            rank_zero_warn(
                f"group_size={n} exceeds the {size} replicas: all replicas form one group, exchanging "
                f"{size - 1} model copies each per outer step. An all-reduce (DiLoCoStrategy) is cheaper."
            )
