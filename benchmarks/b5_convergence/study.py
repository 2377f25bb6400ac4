"""Outer steps studied in B5's ``bytes`` part that the strategies do not offer (yet).

:class:`NoLoCoFromStart`: NoLoCo whose payload is the live weights' difference from the initial weights
θ₀, which every replica holds (the strategies start every replica from the same weights). A low-bit
format's block scales then follow how far training moved each block, not the weights' own size. The
receivers add θ₀ back: a group's mean of the decoded payloads plus θ₀ is its mean of the decoded weights,
the same numbers NoLoCo's update takes, with the same bytes on the wire as NoLoCo's own payload in that
format. One more model copy per replica (θ₀).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterState
from lightning_loco.algorithms.noloco import NoLoCo, NoLoCoState


@dataclass
class FromStartState(NoLoCoState):
    start: Tensor  # θ₀

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "start": self.start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.start.copy_(state_dict["start"])


class NoLoCoFromStart(NoLoCo):
    """NoLoCo (γ = β) sending θ − θ₀ (see the module docstring)."""

    name = "noloco_from_start"

    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> FromStartState:
        return FromStartState(anchor=weights.clone(), momentum=torch.zeros_like(weights), start=weights.clone())

    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        assert isinstance(state, FromStartState) and self.sends_weights_only
        return weights - state.start

    def _weights_sum(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        assert isinstance(state, FromStartState)
        return group_sum.add_(state.start, alpha=group_size)

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        return super().apply(state, self._weights_sum(state, group_sum, group_size), group_size)

    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        return super().final_weights(state, self._weights_sum(state, group_sum, group_size), group_size)
