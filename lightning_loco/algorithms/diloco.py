"""DiLoCo's outer step (Douillard et al., arXiv 2311.08105), the baseline.

All replicas share one anchor ``φ``. Every H inner steps::

    Δ̄ = all_reduce_mean(θ_i − φ)                     # the only collective
    outer optimizer step on φ with gradient  g = −Δ̄   # g = φ − mean θ
    θ_i ← φ                                           # every replica identical again

Paper defaults: outer SGD with lr 0.7, momentum 0.9, Nesterov; H = 500. Any torch optimizer may
serve as the outer optimizer; it steps per-parameter views of the flat float32 anchor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState, check_momentum, check_positive
from lightning_loco.algorithms.defaults import DILOCO
from lightning_loco.algorithms.outer_optimizer import (
    OptimizerOuterState,
    OuterOptimizerFactory,
    SGDFactory,
    anchor_fields,
    check_factory,
)
from lightning_loco.algorithms.schedules import Round, everyone


@dataclass
class DiLoCoState(OptimizerOuterState):
    """φ (identical on every replica), the outer gradient φ − mean θ, and the outer optimizer."""


class DiLoCo(OuterAlgorithm):
    """DiLoCo's outer step.

    Args:
        outer_lr: the outer SGD learning rate (paper: 0.7).
        outer_momentum: the outer SGD momentum (paper: 0.9).
        nesterov: Nesterov momentum for the outer SGD (paper: ``True``). Ignored when the momentum is 0.
        outer_optimizer: builds any torch optimizer from the outer parameters, e.g.
            ``functools.partial(torch.optim.Adam, lr=1e-3)``. When given, the three SGD arguments
            above are not used.
    """

    name = "diloco"
    payload_is_pseudo_gradient = True
    collective = True
    step_weighting = True

    def __init__(
        self,
        outer_lr: float = DILOCO.outer_lr,
        outer_momentum: float = DILOCO.outer_momentum,
        nesterov: bool = DILOCO.nesterov,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
    ) -> None:
        check_factory(outer_optimizer)
        if outer_optimizer is None:
            check_positive("outer_lr", outer_lr, DILOCO.outer_lr)
            check_momentum("outer_momentum", outer_momentum, DILOCO.outer_momentum)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.custom_outer_optimizer = outer_optimizer is not None  # the SGD arguments above then configure nothing
        self.outer_optimizer = outer_optimizer or SGDFactory(self.outer_lr, self.outer_momentum, self.nesterov)

    def keeps_paper_outer_step(self) -> bool:
        return self.outer_optimizer == SGDFactory(DILOCO.outer_lr, DILOCO.outer_momentum, DILOCO.nesterov)

    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        return everyone(num_replicas)

    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> DiLoCoState:
        return DiLoCoState(**anchor_fields(weights, shapes, self.outer_optimizer))

    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        # The pseudo-gradient Δ_i = θ_i − φ: smaller than θ, so its float32 sum loses fewer bits.
        return weights - state.anchor

    def local_proxy(self, state: OuterState, weights: Tensor, group_size: int) -> Tensor:
        """The outer optimizer's step with Δ̄ replaced by this replica's own Δ_i, on a copy."""
        assert isinstance(state, DiLoCoState)
        shadow = DiLoCoState(**state.shadow(self.outer_optimizer))
        return self.apply(shadow, weights - shadow.anchor, 1)  # Δ_i as the group's (single) sum

    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        """mean θ = φ + Δ̄ = φ − g: the replicas' mean live weights, without the outer optimizer's step."""
        assert isinstance(state, DiLoCoState)
        return torch.add(state.anchor, group_sum, alpha=1.0 / group_size)

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        assert isinstance(state, DiLoCoState)
        state.gradient.copy_(group_sum).div_(-group_size)  # g = φ − mean θ = −Δ̄
        return state.step()


def sgd_beside_optimizer(a: DiLoCo) -> Optional[str]:
    """DiLoCo's outer SGD arguments changed beside an ``outer_optimizer``, which replaces that SGD (a rule of
    lightning_loco.rules, which names and documents it; None: the arguments are fine)."""
    if not a.custom_outer_optimizer:
        return None
    changed = [f"{n}={v!r}" for n, v, d in (("outer_lr", a.outer_lr, DILOCO.outer_lr),
                                            ("outer_momentum", a.outer_momentum, DILOCO.outer_momentum),
                                            ("nesterov", a.nesterov, DILOCO.nesterov)) if v != d]
    if not changed:
        return None
    one = len(changed) == 1
    return (f"{', '.join(changed)} {'configures' if one else 'configure'} DiLoCo's default outer SGD, which "
            f"outer_optimizer replaces. Put {'it' if one else 'them'} in the outer optimizer (e.g. "
            "functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)), or drop outer_optimizer.")
