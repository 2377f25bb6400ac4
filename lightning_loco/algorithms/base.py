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

from lightning_loco.codecs import WireFormat, check_payload, roundtrip_segments, segments
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
    # Whether the payload is a pseudo-gradient (θ − φ, DiLoCo), which error feedback suits, rather than
    # weights (NoLoCo's θ, GASLoC's z): see docs/compression.md.
    payload_is_pseudo_gradient: ClassVar[bool] = False

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

    def post(
        self, state: OuterState, weights: Tensor, outer_step: int, transport: "Transport", keep_own: bool = False,
        wire: Optional[WireFormat] = None, residual: Optional[Tensor] = None, who: str = "",
        measure_error: bool = False,
    ) -> "Posted":
        """Starts round ``outer_step`` for this replica: computes its payload from ``weights`` and posts
        the group's sum on ``transport`` (it travels while the caller goes on). The state is not
        changed until ``apply``. With ``keep_own``, ``Posted.own`` is this replica's payload as sent
        (a copy taken before an all-reduce starts summing into it).

        ``wire``: the wire format (default: float32 as it is). A payload with NaN or inf raises
        :class:`~lightning_loco.codecs.PayloadError` naming ``who`` before anything is sent, whatever
        the format. With a lossy codec and ``residual`` (the error-feedback residual e, updated in
        place), the payload sent is Δ + e and e becomes what the codec loses of it.
        ``Posted.compression_error`` is ‖D(Q(x)) − x‖ of the payload x sent, known with a residual and
        computed with ``measure_error``."""
        round_ = self.schedule(outer_step, transport.num_replicas)
        group = round_.group_of(transport.replica)
        who = who or f"Replica {transport.replica}, outer step {outer_step}"
        payload = self.payload(state, weights)
        codec = wire.codec if wire is not None and wire.lossy else None
        talks = len(group) > 1 or (round_.collective and transport.num_replicas > 1)
        if codec is not None and not talks:
            codec = None  # nobody to send to: nothing is encoded, nothing is lost
        error = None
        if codec is not None and (residual is not None or measure_error):
            if residual is not None:
                if residual.numel() != payload.numel():
                    raise ValueError(f"{who}: the residual has {residual.numel()} values, the payload {payload.numel()}")
                payload = payload + residual  # a new tensor: never the live weights
            check_payload(payload, codec, who)
            parts = segments(payload.numel(), getattr(transport, "ranks_per_replica", 1),
                             transport.num_replicas if round_.collective else 1)
            lost = payload - roundtrip_segments(payload, codec, parts)
            if residual is not None:
                residual.copy_(lost)
            error = torch.linalg.vector_norm(lost).item()
        else:
            check_payload(payload, codec, who)
        own = None
        if keep_own:
            own = payload.clone() if round_.collective else payload
        extra = {} if codec is None else {"codec": codec}  # transports without codecs keep working in float32
        if round_.collective:
            pending = transport.start_all_reduce_sum(payload, **extra)
        else:
            pending = transport.start_group_sum(payload, group, **extra)
        return Posted(tuple(group), round_.collective, payload, pending, own, error)

    def step(
        self, state: OuterState, weights: Tensor, outer_step: int, transport: "Transport",
        wire: Optional[WireFormat] = None, residual: Optional[Tensor] = None,
    ) -> tuple[Tensor, tuple[int, ...]]:
        """One whole, blocking outer step of this replica over ``transport``: returns the new live
        weights and the group this replica met. ``wire`` and ``residual`` as in :meth:`post`."""
        posted = self.post(state, weights, outer_step, transport, wire=wire, residual=residual)
        return self.apply(state, posted.pending.wait(), len(posted.group)), posted.group


@dataclass
class Posted:
    """A round this replica has posted: its group, its payload and the exchange in flight."""

    group: tuple[int, ...]
    collective: bool  # an all-reduce, which sums in place into ``payload``
    payload: Tensor
    pending: "Pending"
    own: Optional[Tensor] = None  # the payload as sent, when asked for (``post(keep_own=True)``)
    compression_error: Optional[float] = None  # ‖D(Q(x)) − x‖ of the payload x sent (lossy wire formats)


def check_positive(name: str, value: float, paper_default: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}. The paper uses {paper_default}.")


def check_momentum(name: str, value: float, paper_default: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(
            f"{name} must be in [0, 1), got {value}. The paper uses {paper_default}; 0 turns momentum off."
        )
