"""The interface between an outer-step algorithm and the code that runs it.

An outer step is split in three so that the same maths runs under real processes (the Lightning
strategies) and in a single process over simulated replicas (:mod:`lightning_loco.simulator`):

1. ``payload(state, weights)``: what this replica contributes, one flat float32 buffer;
2. the runner sums the payloads of this replica's group (``schedule(t, N)`` says who is in it):
   point to point inside the group, or one all-reduce when the round is ``collective``. Posting the
   round (the payload check, a wire format's codec and error-feedback residual, the transport) is
   :mod:`lightning_loco.driver.rounds`'s job, not the algorithm's;
3. ``apply(state, group_sum, group_size)``: updates the outer state and returns the new live weights.

``final_weights`` is the group's combination without the outer step's momentum extrapolation, from
what ``apply`` sees: the live weights of the round that ends training (nothing after it corrects an
overshoot), while ``apply`` still updates the outer state as usual.

``local_proxy`` is the outer step with every received quantity replaced by the replica's own: the
prediction that overlapped training starts from while the real exchange is in flight
(:mod:`lightning_loco.driver.overlap`).

Algorithms never import ``torch.distributed``, a transport, a codec or Lightning: they are plain tensor maths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_loco.algorithms.schedules import Round


class OuterState(ABC):
    """One replica's outer state for one inner optimizer (float32 tensors)."""

    anchor: Tensor

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (loadable with ``torch.load(weights_only=True)``)."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class OuterAlgorithm(ABC):
    """The maths of one outer step, on flat float32 buffers.

    What an algorithm can do is declared here, as attributes (an algorithm whose capabilities depend on
    its arguments sets them in ``__init__``); the driver, the rules of :mod:`lightning_loco.replica.options` and
    elastic replicas read them, never the algorithm's name:

    * ``collective``: every round is one all-reduce over all replicas (DiLoCo; GASLoC on the complete
      topology), rather than point-to-point sums inside groups. A collective round that a replica
      finishes without its partners is dropped (the replicas must keep one anchor);
    * ``seeded_schedule``: the peers of round t are drawn from ``self.seed`` and t, so each streaming
      fragment gets a seed of its own (:func:`lightning_loco.driver.fragments.fragment_algorithm`);
    * ``any_replica_count``: the schedule serves any number of replicas (elastic memberships change);
    * ``overlap_share``: the largest share of a round's H that ``overlap_steps="auto"`` may overlap,
      where our simulation found the loss change small (docs/algorithms.md);
    * ``step_weighting``: ``apply`` uses the group's size only as the divisor of a mean, so the merge
      weighted by inner steps (``merge="steps"``) can serve it
      (:mod:`lightning_loco.algorithms.step_weighted`);
    * ``payload_is_pseudo_gradient``: the payload is a pseudo-gradient (θ − φ, DiLoCo), which error
      feedback suits, rather than weights (NoLoCo's θ, GASLoC's z): see docs/compression.md.
    """

    name: ClassVar[str]
    payload_is_pseudo_gradient: bool = False
    collective: bool = False
    seeded_schedule: bool = False
    any_replica_count: bool = True
    overlap_share: float = 0.25
    step_weighting: bool = False

    def check_num_replicas(self, num_replicas: int) -> None:
        """Raises ``ValueError`` if the algorithm cannot run on ``num_replicas`` (checked early)."""

    def keeps_paper_outer_step(self) -> bool:
        """Whether the outer step's arguments are the paper's defaults (the short-run warning of
        :mod:`lightning_loco.replica.short_runs` is for those); False for an algorithm without paper defaults."""
        return False

    @abstractmethod
    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        """Who combines payloads with whom at ``outer_step`` (identical on every replica)."""

    @abstractmethod
    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> OuterState:
        """The outer state at the start of training; ``weights`` is the flat live model."""

    def phase_ended(self, state: OuterState, steps: int) -> None:
        """Told, just before ``payload``, the inner steps H_i of the phase this round ends (default:
        nothing; the merge weighted by steps sends them: :mod:`lightning_loco.algorithms.step_weighted`)."""

    @abstractmethod
    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        """The buffer this replica contributes to its group's sum. May be summed in place."""

    def payload_numel(self, state: OuterState) -> int:
        """The number of values ``payload`` returns (the size of an error-feedback residual)."""
        return state.anchor.numel()

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


def check_positive(name: str, value: float, paper_default: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}. The paper uses {paper_default}.")


def check_momentum(name: str, value: float, paper_default: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(
            f"{name} must be in [0, 1), got {value}. The paper uses {paper_default}; 0 turns momentum off."
        )
