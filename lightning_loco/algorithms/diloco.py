"""DiLoCo's outer step (Douillard et al., arXiv 2311.08105), the baseline.

All replicas share one anchor ``φ``. Every H inner steps::

    Δ̄ = all_reduce_mean(θ_i − φ)                     # the only collective
    outer optimizer step on φ with gradient  g = −Δ̄   # g = φ − mean θ
    θ_i ← φ                                           # every replica identical again

Paper defaults: outer SGD with lr 0.7, momentum 0.9, Nesterov; H = 500. Any torch optimizer may
serve as the outer optimizer; it steps per-parameter views of the flat float32 anchor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState, check_momentum, check_positive
from lightning_loco.flat import parameter_views
from lightning_loco.schedules import Round, everyone

OuterOptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], Optimizer]


@dataclass
class DiLoCoState(OuterState):
    anchor: Tensor  # φ, identical on every replica
    gradient: Tensor  # the outer gradient φ − mean θ; the views' .grad live in it
    optimizer: Optimizer  # steps parameter views of ``anchor``

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.anchor.copy_(state_dict["anchor"])
        self.optimizer.load_state_dict(state_dict["optimizer"])


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

    def __init__(
        self,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
    ) -> None:
        if outer_optimizer is None:
            check_positive("outer_lr", outer_lr, 0.7)
            check_momentum("outer_momentum", outer_momentum, 0.9)
        elif not callable(outer_optimizer):
            raise ValueError(
                "outer_optimizer must be a callable that builds an optimizer from parameters, e.g. "
                f"functools.partial(torch.optim.SGD, lr=0.7), got {outer_optimizer!r}"
            )
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.outer_optimizer = outer_optimizer

    def _build_optimizer(self, params: list[torch.nn.Parameter]) -> Optimizer:
        if self.outer_optimizer is not None:
            optimizer = self.outer_optimizer(params)
            if not isinstance(optimizer, Optimizer):
                raise ValueError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(optimizer)}")
            return optimizer
        # torch refuses Nesterov without momentum; with momentum 0 both are plain SGD anyway.
        nesterov = self.nesterov and self.outer_momentum > 0
        return partial(torch.optim.SGD, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=nesterov)(params)

    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        return everyone(num_replicas)

    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> DiLoCoState:
        anchor = weights.clone()
        gradient = torch.zeros_like(anchor)
        params = parameter_views(anchor, shapes)
        for p, g in zip(params, parameter_views(gradient, shapes)):
            p.grad = g.detach()
        return DiLoCoState(anchor=anchor, gradient=gradient, optimizer=self._build_optimizer(params))

    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        # The pseudo-gradient Δ_i = θ_i − φ: smaller than θ, so its float32 sum loses fewer bits.
        return weights - state.anchor

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        assert isinstance(state, DiLoCoState)
        state.gradient.copy_(group_sum).div_(-group_size)  # g = φ − mean θ = −Δ̄
        state.optimizer.step()
        return state.anchor
