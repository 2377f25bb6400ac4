"""NoLoCo's outer step (Kolehmainen et al., arXiv 2506.10911).

Replica ``i`` keeps its own anchor ``φ_i`` and momentum ``δ_i`` (float32). At outer step ``t`` the
replicas split into random groups ``G`` drawn from ``(seed, t)`` and each replica computes::

    Δ̄ = mean_{j∈G} (θ_j − φ_j)        φ̄ = mean_{j∈G} φ_j
    δ_i ← α·δ_i + β·Δ̄ − γ·(φ_i − φ̄)
    φ_i ← φ_i + δ_i;   θ_i ← φ_i

with α = ``outer_momentum``, β = ``outer_lr``, γ = ``averaging_rate``.

Two decisions that the paper leaves open or gets wrong:

* The paper's Eq. 2 prints ``− β·Δ̄``; with ``φ ← φ + δ`` that moves away from the inner progress and
  diverges. The paper's appendix (its Eq. 32) and the reference code use ``+ β·Δ̄``, as here.
* γ is not stated in the paper; the reference code uses γ = β, our default. Then the update
  simplifies to ``δ_i ← α·δ_i + β·(mean_{j∈G} θ_j − φ_i)`` and only the live weights travel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState, check_momentum, check_positive
from lightning_loco.algorithms.defaults import NOLOCO
from lightning_loco.algorithms.schedules import Round, random_groups


@dataclass
class NoLoCoState(OuterState):
    anchor: Tensor  # φ_i
    momentum: Tensor  # δ_i

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor, "momentum": self.momentum}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.anchor.copy_(state_dict["anchor"])
        self.momentum.copy_(state_dict["momentum"])


def stability_interval(outer_momentum: float) -> tuple[float, float]:
    """The open interval of γ in which the pair update is stable (paper appendix): α < γ < √(2 + α²)."""
    return outer_momentum, math.sqrt(2.0 + outer_momentum**2)


class NoLoCo(OuterAlgorithm):
    """NoLoCo's outer step.

    Args:
        outer_lr: β, the outer learning rate (paper: 0.7).
        outer_momentum: α, the outer momentum (paper: 0.5).
        averaging_rate: γ, the pull towards the group's mean anchor. ``None`` means γ = β, as in the
            reference code (the paper does not state it).
        group_size: n, the number of replicas that meet at each outer step (paper: 2).
        seed: seeds the groups together with the outer-step index.
    """

    name = "noloco"
    seeded_schedule = True
    overlap_share = 0.5  # predict-correct at τ = H/2 cost NoLoCo at most +0.009 in our simulation
    step_weighting = True

    def __init__(
        self,
        outer_lr: float = NOLOCO.outer_lr,
        outer_momentum: float = NOLOCO.outer_momentum,
        averaging_rate: Optional[float] = NOLOCO.averaging_rate,
        group_size: int = NOLOCO.group_size,
        seed: int = NOLOCO.seed,
    ) -> None:
        check_positive("outer_lr (β)", outer_lr, NOLOCO.outer_lr)
        check_momentum("outer_momentum (α)", outer_momentum, NOLOCO.outer_momentum)
        if averaging_rate is not None and not averaging_rate >= 0:
            raise ValueError(
                f"averaging_rate (γ) must be >= 0 or None (None means γ = outer_lr), got {averaging_rate}."
            )
        if not isinstance(group_size, int) or group_size < 2:
            raise ValueError(
                f"group_size (n) must be an integer >= 2, got {group_size!r}. "
                f"The paper uses {NOLOCO.group_size} (pairs)."
            )
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.averaging_rate = float(outer_lr if averaging_rate is None else averaging_rate)
        self.group_size = group_size
        self.seed = int(seed)

    @property
    def sends_weights_only(self) -> bool:
        """With γ = β only the live weights travel (one model copy); otherwise weights and anchor."""
        return self.averaging_rate == self.outer_lr

    def keeps_paper_outer_step(self) -> bool:
        paper = (NOLOCO.outer_lr, NOLOCO.outer_momentum, NOLOCO.outer_lr)  # γ = β by default
        return (self.outer_lr, self.outer_momentum, self.averaging_rate) == paper

    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        return random_groups(num_replicas, self.group_size, self.seed, outer_step)

    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> NoLoCoState:
        return NoLoCoState(anchor=weights.clone(), momentum=torch.zeros_like(weights))

    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        assert isinstance(state, NoLoCoState)
        if self.sends_weights_only:
            return weights
        return torch.cat([weights, state.anchor])

    def payload_numel(self, state: OuterState) -> int:
        return state.anchor.numel() * (1 if self.sends_weights_only else 2)

    def local_proxy(self, state: OuterState, weights: Tensor, group_size: int) -> Tensor:
        """φ + α·δ + β·(θ − φ): the update with the group's mean replaced by this replica's own values
        (the γ term vanishes)."""
        assert isinstance(state, NoLoCoState)
        proxy = torch.lerp(state.anchor, weights, self.outer_lr)
        return proxy.add_(state.momentum, alpha=self.outer_momentum)

    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        """mean_{j∈G} θ_j: the group's mean live weights, without the momentum δ and the pull β
        towards the anchor."""
        assert isinstance(state, NoLoCoState)
        weights = group_sum if self.sends_weights_only else group_sum[: state.anchor.numel()]
        return weights / group_size

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        assert isinstance(state, NoLoCoState)
        phi, delta = state.anchor, state.momentum
        delta.mul_(self.outer_momentum)
        if self.sends_weights_only:
            # β·Δ̄ − β·(φ_i − φ̄) = β·(mean θ − φ_i)
            mean_weights = group_sum.div_(group_size)
            delta.add_(mean_weights.sub_(phi), alpha=self.outer_lr)
        else:
            mean_weights, mean_anchor = group_sum.div_(group_size).chunk(2)
            delta.add_(mean_weights - mean_anchor, alpha=self.outer_lr)
            delta.sub_(phi - mean_anchor, alpha=self.averaging_rate)
        phi.add_(delta)
        return phi
