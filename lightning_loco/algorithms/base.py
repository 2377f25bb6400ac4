"""The interface between an outer-step algorithm and the code that runs it.

An outer step is split in three so that the same maths runs under real processes (the Lightning
strategies) and in a single process over simulated replicas (:mod:`lightning_loco.simulator`):

1. ``payload(state, weights)``: what this replica contributes, one flat float32 buffer;
2. the runner sums the payloads of this replica's group (``schedule(t, N)`` says who is in it):
   point to point inside the group, or one all-reduce when the round is ``collective``;
3. ``apply(state, group_sum, group_size)``: updates the outer state and returns the new live weights.

``final_weights`` is the group's combination without the outer step's momentum extrapolation, from
what ``apply`` sees: the live weights of the round that ends training (nothing after it corrects an
overshoot), while ``apply`` still updates the outer state as usual.

``local_proxy`` is the outer step with every received quantity replaced by the replica's own: the
prediction that overlapped training starts from while the real exchange is in flight
(:mod:`lightning_loco.overlap`).

Algorithms never import ``torch.distributed`` or Lightning: they are plain tensor maths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from torch import Tensor

from lightning_loco.schedules import Round

if TYPE_CHECKING:
    from lightning_loco.transport.base import Pending, Transport


class OuterState(ABC):
    """One replica's outer state for one inner optimizer (float32 tensors)."""

    anchor: Tensor

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (loadable with ``torch.load(weights_only=True)``)."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class OuterAlgorithm(ABC):
    """The maths of one outer step, on flat float32 buffers."""

    name: ClassVar[str]

    def check_num_replicas(self, num_replicas: int) -> None:
        """Raises ``ValueError`` if the algorithm cannot run on ``num_replicas`` (checked early)."""

    @abstractmethod
    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        """Who combines payloads with whom at ``outer_step`` (identical on every replica)."""

    @abstractmethod
    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> OuterState:
        """The outer state at the start of training; ``weights`` is the flat live model."""

    @abstractmethod
    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        """The buffer this replica contributes to its group's sum. May be summed in place."""

    @abstractmethod
    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        """Finishes the outer step from the group's summed payloads; returns the new live weights."""

    @abstractmethod
    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        """The live weights for the round that ends training: what ``apply(state, group_sum,
        group_size)`` combines, without the outer step's momentum extrapolation (a new tensor; called
        before ``apply``, it changes neither ``state`` nor ``group_sum``)."""

    @abstractmethod
    def local_proxy(self, state: OuterState, weights: Tensor, group_size: int) -> Tensor:
        """The new live weights this replica would get if every member of its group had sent what it
        sends (a new tensor; ``state`` is not changed): ``apply(payload · group_size)`` on a copy of
        the state, in closed form where the algorithm has one."""

    def post(
        self, state: OuterState, weights: Tensor, outer_step: int, transport: "Transport", keep_own: bool = False
    ) -> "Posted":
        """Starts round ``outer_step`` for this replica: computes its payload from ``weights`` and posts
        the group's sum on ``transport`` (it travels while the caller goes on). The state is not
        changed until ``apply``. With ``keep_own``, ``Posted.own`` is this replica's payload as sent
        (a copy taken before an all-reduce starts summing into it)."""
        round_ = self.schedule(outer_step, transport.num_replicas)
        group = round_.group_of(transport.replica)
        payload = self.payload(state, weights)
        own = None
        if keep_own:
            own = payload.clone() if round_.collective else payload
        if round_.collective:
            pending = transport.start_all_reduce_sum(payload)
        else:
            pending = transport.start_group_sum(payload, group)
        return Posted(tuple(group), round_.collective, payload, pending, own)

    def step(
        self, state: OuterState, weights: Tensor, outer_step: int, transport: "Transport"
    ) -> tuple[Tensor, tuple[int, ...]]:
        """One whole, blocking outer step of this replica over ``transport``: returns the new live
        weights and the group this replica met."""
        posted = self.post(state, weights, outer_step, transport)
        return self.apply(state, posted.pending.wait(), len(posted.group)), posted.group


@dataclass
class Posted:
    """A round this replica has posted: its group, its payload and the exchange in flight."""

    group: tuple[int, ...]
    collective: bool  # an all-reduce, which sums in place into ``payload``
    payload: Tensor
    pending: "Pending"
    own: Optional[Tensor] = None  # the payload as sent, when asked for (``post(keep_own=True)``)


def check_positive(name: str, value: float, paper_default: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}. The paper uses {paper_default}.")


def check_momentum(name: str, value: float, paper_default: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(
            f"{name} must be in [0, 1), got {value}. The paper uses {paper_default}; 0 turns momentum off."
        )
