"""``GASLoCStrategy``: gossip over sparse matchings, with the outer momentum as gossip acceleration."""

from __future__ import annotations

from typing import Any, Literal, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_loco.algorithms.defaults import GASLOC
from lightning_loco.algorithms.gasloc import GASLoC, stability_note
from lightning_loco.algorithms.outer_optimizer import OuterOptimizerFactory
from lightning_loco.trainer.base import OuterStepStrategy


class GASLoCArguments:
    """GASLoC's own arguments, for the Trainer's strategy and Fabric's alike (see :class:`GASLoCStrategy`)."""

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
        algorithm = GASLoC(
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            gossip_step=gossip_step,
            topology=topology,
            seed=seed,
            outer_optimizer=outer_optimizer,
            momentum_on=momentum_on,
        )
        # With a custom outer optimizer γ is not used: only α can leave the simulated range then.
        momentum = algorithm.outer_momentum if outer_optimizer is None else None
        note = stability_note(topology, algorithm.gossip_step, momentum, momentum_on)
        if note is not None:
            rank_zero_warn(note)
        super().__init__(algorithm, sync_every, **kwargs)  # type: ignore[call-arg]


class GASLoCStrategy(GASLoCArguments, OuterStepStrategy):
    """GASLoC (Cagnasso, Belilovsky, Oyallon, arXiv 2606.11081), as reconstructed here (the paper's
    full text was not available; see ``docs/algorithms.md``).

    Every ``sync_every`` inner optimizer steps each replica moves η along its pseudo-gradient
    (z = θ + η·g), mixes z with its peer of the round (x = z − α·Σ(z − z_j)), and extrapolates with
    momentum (θ ← x + γ·(x − x_prev), i.e. Nesterov SGD with lr 1 on d = θ − x). Only z travels:
    one model copy to one peer per outer step, point to point.

    Args:
        sync_every: H, inner optimizer steps between outer steps.
        outer_lr: η, the step along the pseudo-gradient before mixing.
        outer_momentum: γ, the outer momentum, which also accelerates the gossip (of the default SGD).
        gossip_step: α in (0, 1]: how far a replica moves towards its peer (½: exact pair average).
        topology: "random_pairs", "ring", "exponential" (N a power of two) or "complete" (DiLoCo exactly).
        seed: seeds the random matchings (with the outer-step index), not the global RNG.
        outer_optimizer: a torch optimizer over the anchor in place of SGD(lr=1, momentum=γ, nesterov=True).
        momentum_on: where γ acts: "mixed" (our reconstruction) or "sent" (the public summary's form).
        **kwargs: the options every strategy shares: see ``OuterStepStrategy`` and docs/options.md.
    """

    strategy_name = "gasloc"
    description = "GASLoC: H local steps, then gossip with one peer and momentum extrapolation"
