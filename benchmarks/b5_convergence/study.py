"""Outer steps studied in B5's ``bytes`` part that the strategies do not offer (yet).

:class:`NoLoCoFromStart`: NoLoCo whose payload is the live weights' difference from the initial weights
θ₀, which every replica holds (the strategies start every replica from the same weights). A low-bit
format's block scales then follow how far training moved each block, not the weights' own size. The
receivers add θ₀ back: a group's mean of the decoded payloads plus θ₀ is its mean of the decoded weights,
the same numbers NoLoCo's update takes, with the same bytes on the wire as NoLoCo's own payload in that
format. One more model copy per replica (θ₀).

:class:`NoLoCoPairwise`: CHOCO-gossip's public copies for random pairs. Every pair of replicas (i, j) keeps a
reference r_ij, the same on both sides: θ₀ until they first meet, then the mean of the two decoded weights
of their last meeting (both compute it from the same two messages, bitwise alike). A replica sends
θ − r_ij to its peer of the round, which adds r_ij back: the difference is what both moved since they last met
(about N − 1 rounds ago with random pairs), not the weights. N − 1 more model copies per replica. The
driver asks for a replica's group (``Round.group_of``) right before it computes that replica's payload, in the
same thread (the simulator runs each replica's round in a thread of its own); the study's round remembers,
per thread, who asked last, which is how the payload knows its peer (the strategies' algorithms are not told
which replica they run on).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterState
from lightning_loco.algorithms.noloco import NoLoCo, NoLoCoState
from lightning_loco.algorithms.schedules import Round


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
        """The group's sum of decoded weights, a new tensor (the driver passes the same sum to
        ``final_weights`` and ``apply`` at the last round)."""
        assert isinstance(state, FromStartState)
        return group_sum.add(state.start, alpha=group_size)

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        return super().apply(state, self._weights_sum(state, group_sum, group_size), group_size)

    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        return super().final_weights(state, self._weights_sum(state, group_sum, group_size), group_size)


class _Asked(threading.local):
    """Who asked for their group last, and the group, in this thread."""

    last: tuple[int, tuple[int, ...]] | None = None


@dataclass(frozen=True)
class _AskedRound(Round):
    """A round that tells ``asked`` who asked for their group last, in each thread."""

    asked: _Asked = field(default_factory=_Asked, compare=False)

    def group_of(self, replica: int) -> tuple[int, ...]:
        group = super().group_of(replica)
        self.asked.last = (replica, group)
        return group


@dataclass
class PairwiseState(NoLoCoState):
    start: Tensor  # θ₀
    references: dict[int, Tensor] = field(default_factory=dict)  # peer → r_ij
    peer: int = -1  # this round's (−1: no pair this round)

    def reference(self, peer: int) -> Tensor:
        return self.references.get(peer, self.start)


class NoLoCoPairwise(NoLoCo):
    """NoLoCo (γ = β, pairs) sending θ − r_ij to this round's peer j (see the module docstring)."""

    name = "noloco_pairwise"

    def __init__(self) -> None:
        super().__init__()
        self.asked = _Asked()

    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        base = super().schedule(outer_step, num_replicas)
        return _AskedRound(groups=base.groups, collective=base.collective, asked=self.asked)

    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> PairwiseState:
        return PairwiseState(anchor=weights.clone(), momentum=torch.zeros_like(weights), start=weights.clone())

    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        assert isinstance(state, PairwiseState) and self.sends_weights_only and self.asked.last is not None
        me, group = self.asked.last
        self.asked.last = None  # each payload after its own group_of
        state.peer = next(j for j in group if j != me) if len(group) == 2 else -1
        return weights - state.reference(state.peer) if state.peer >= 0 else weights

    def _weights_sum(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        """The group's sum of decoded weights, a new tensor (see :class:`NoLoCoFromStart`)."""
        assert isinstance(state, PairwiseState)
        return group_sum.clone() if state.peer < 0 else group_sum.add(state.reference(state.peer), alpha=group_size)

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        assert isinstance(state, PairwiseState)
        total = self._weights_sum(state, group_sum, group_size)
        if state.peer >= 0:  # the pair's mean decoded weights: the same bits on both sides
            state.references[state.peer] = total / group_size
        return super().apply(state, total, group_size)

    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        return super().final_weights(state, self._weights_sum(state, group_sum, group_size), group_size)
