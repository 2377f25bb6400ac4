"""The papers' defaults of each outer step, written once: the algorithms' signatures and messages, the
strategies' signatures (Trainer and Fabric) and the rules about an algorithm's own arguments read them here
(``tests/test_options.py`` checks that no other module writes them again)."""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional

Topology = Literal["random_pairs", "ring", "exponential", "complete"]
MomentumOn = Literal["mixed", "sent"]


class NoLoCoDefaults(NamedTuple):
    """NoLoCo (Kolehmainen et al., arXiv 2506.10911)."""

    sync_every: int = 50  # H
    outer_lr: float = 0.7  # β
    outer_momentum: float = 0.5  # α
    averaging_rate: Optional[float] = None  # γ (None: γ = β, as the reference code)
    group_size: int = 2  # n, replicas per group (pairs)
    seed: int = 0


class DiLoCoDefaults(NamedTuple):
    """DiLoCo (Douillard et al., arXiv 2311.08105): the outer SGD's arguments."""

    sync_every: int = 500  # H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True


class GASLoCDefaults(NamedTuple):
    """GASLoC (Cagnasso, Belilovsky, Oyallon, arXiv 2606.11081), as reconstructed (docs/algorithms.md)."""

    sync_every: int = 50  # H
    outer_lr: float = 0.7  # η
    outer_momentum: float = 0.5  # γ
    gossip_step: float = 0.25  # α
    topology: Topology = "random_pairs"
    seed: int = 0
    momentum_on: MomentumOn = "mixed"


NOLOCO = NoLoCoDefaults()
DILOCO = DiLoCoDefaults()
GASLOC = GASLoCDefaults()
