"""Each algorithm's own arguments as its strategies take them, the Trainer's and Fabric's alike: the algorithm built
from them with the warnings their values call for, and what both strategies of an algorithm say of themselves (its
name, description and docstring).

Plain Python: each adapter passes its own warning function (Lightning's ``rank_zero_warn``), and declares the
arguments in its own ``__init__`` with the defaults of :mod:`lightning_loco.algorithms.defaults`, so that
LightningCLI sees each with its type and default.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from lightning_loco.algorithms.defaults import MomentumOn, Topology
from lightning_loco.algorithms.diloco import DiLoCo
from lightning_loco.algorithms.gasloc import GASLoC, stability_note
from lightning_loco.algorithms.noloco import NoLoCo, stability_interval
from lightning_loco.algorithms.outer_optimizer import OuterOptimizerFactory

Warn = Callable[[str], object]


class StrategyText(NamedTuple):
    """What the Trainer's and Fabric's strategies of one algorithm say of themselves."""

    name: str  # the registry's name: Trainer(strategy=...), Fabric(strategy=...)
    description: str
    doc: str  # the class docstring (LightningCLI's help reads each argument's line in it)


def build_noloco(
    *, outer_lr: float, outer_momentum: float, averaging_rate: Optional[float], group_size: int, seed: int, warn: Warn
) -> NoLoCo:
    """NoLoCo from the strategy's arguments; warns when γ is outside the stability interval."""
    algorithm = NoLoCo(outer_lr=outer_lr, outer_momentum=outer_momentum, averaging_rate=averaging_rate,
                       group_size=group_size, seed=seed)
    low, high = stability_interval(algorithm.outer_momentum)
    if not low < algorithm.averaging_rate < high:
        warn(
            f"NoLoCo's averaging_rate γ={algorithm.averaging_rate} is outside the stability interval "
            f"α < γ < √(2 + α²) = ({low:.3g}, {high:.3g}) for outer_momentum α={algorithm.outer_momentum}; "
            "replicas may drift apart. Use averaging_rate=None (γ = outer_lr) or a value inside it."
        )
    return algorithm


def noloco_group_note(group_size: int, replicas: int) -> Optional[str]:
    """Why NoLoCo's groups are a poor fit for ``replicas`` (None when they fit): one group of them all."""
    if 1 < replicas < group_size:
        return (
            f"group_size={group_size} exceeds the {replicas} replicas: all replicas form one group, exchanging "
            f"{replicas - 1} model copies each per outer step. An all-reduce (DiLoCoStrategy) is cheaper."
        )
    return None


def build_gasloc(
    *,
    outer_lr: float,
    outer_momentum: float,
    gossip_step: float,
    topology: Topology,
    seed: int,
    outer_optimizer: Optional[OuterOptimizerFactory],
    momentum_on: MomentumOn,
    warn: Warn,
) -> GASLoC:
    """GASLoC from the strategy's arguments; warns when they leave the range the simulations found stable."""
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
        warn(note)
    return algorithm


def build_diloco(
    *, outer_lr: float, outer_momentum: float, nesterov: bool, outer_optimizer: Optional[OuterOptimizerFactory]
) -> DiLoCo:
    """DiLoCo from the strategy's arguments (its checks are the algorithm's own)."""
    return DiLoCo(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov, outer_optimizer=outer_optimizer)


NOLOCO_TEXT = StrategyText(
    "noloco",
    "NoLoCo: H local steps, then partial averaging with one random peer (no collective)",
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
    """,
)

GASLOC_TEXT = StrategyText(
    "gasloc",
    "GASLoC: H local steps, then gossip with one peer and momentum extrapolation",
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
    """,
)

DILOCO_TEXT = StrategyText(
    "diloco",
    "DiLoCo: H local steps, then an all-reduce of pseudo-gradients and an outer optimizer step",
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
    """,
)
