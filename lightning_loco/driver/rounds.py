"""Posting one round of an outer step: payload → check → codec and residual → transport → ``Posted``.

The algorithms (:mod:`lightning_loco.algorithms`) are maths on flat tensors; the transports
(:mod:`lightning_loco.transport`) move buffers. This module is where the two meet, once per round:

1. the round's schedule (``algorithm.schedule(t, N)``, computed once by the caller) says who is in
   this replica's group and whether the round is one collective (DiLoCo's all-reduce) or
   point-to-point sums inside groups;
2. ``algorithm.payload(state, weights)`` is what this replica contributes;
3. with a lossy wire format the payload is checked for NaN/inf (always, whatever the format), the
   error-feedback residual is added, and what the codec will lose becomes the new residual;
4. ``transport.start_group_sum`` or ``start_all_reduce_sum`` posts the exchange with the round's
   identity (:class:`~lightning_loco.transport.base.RoundId`) and returns a
   :class:`~lightning_loco.transport.base.Pending`, which travels while training goes on.

Steps 1-3 are :func:`prepare` (a :class:`Payload`), step 4 :func:`send`; :func:`post` is the two.
The driver (:mod:`lightning_loco.driver.driver`) calls them when a round is due (its record,
:mod:`lightning_loco.driver.record`, looks at the payload in between) and, at the landing,
``pending.wait()`` and ``algorithm.apply``. :func:`step` is the whole round, blocking, for studies
and benchmarks that time one outer step. Nothing here observes: the mechanism's inputs go in, the
payload and the exchange come out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.algorithms.schedules import Round
from lightning_loco.transport.base import Pending, RoundId, Transport
from lightning_loco.wire.codecs import Codec, WireFormat, check_payload, roundtrip_segments, segments


@dataclass
class Payload:
    """What this replica sends in one round, checked and ready for the transport."""

    tensor: Tensor  # a collective round's transport sums into it in place
    group: tuple[int, ...]
    collective: bool  # an all-reduce (else point-to-point sums inside ``group``)
    codec: Optional[Codec] = None  # the lossy codec it travels in (None: float32 as it is, or nobody to send to)
    parts: tuple[tuple[int, int], ...] = ()  # the segments the transport encodes apart (with a codec)
    lost: Optional[Tensor] = None  # with error feedback: what the codec loses of it (the new residual)

    def loss(self) -> Optional[Tensor]:
        """D(Q(x)) − x of the payload x, ``None`` without a lossy codec: computed once, before it is sent."""
        if self.lost is None and self.codec is not None:
            self.lost = self.tensor - roundtrip_segments(self.tensor, self.codec, self.parts)
        return self.lost


@dataclass
class Posted:
    """A round this replica has posted: its group, its payload and the exchange in flight."""

    group: tuple[int, ...]
    collective: bool  # an all-reduce, which sums in place into ``payload``
    payload: Tensor
    pending: Pending


def prepare(
    algorithm: OuterAlgorithm, state: OuterState, weights: Tensor, outer_step: int, transport: Transport, *,
    wire: Optional[WireFormat] = None, residual: Optional[Tensor] = None, who: str = "",
    schedule: Optional[Round] = None,
) -> Payload:
    """This replica's payload for round ``outer_step``, computed from ``weights`` and checked; nothing is
    sent and the outer state is not changed. ``wire``, ``residual``, ``who`` and ``schedule`` as in :func:`post`."""
    round_ = schedule if schedule is not None else algorithm.schedule(outer_step, transport.num_replicas)
    group = round_.group_of(transport.replica)
    who = who or f"Replica {transport.replica}, outer step {outer_step}"
    payload = algorithm.payload(state, weights)
    codec = wire.codec if wire is not None and wire.lossy else None
    talks = len(group) > 1 or (round_.collective and transport.num_replicas > 1)
    if codec is None or not talks:  # nobody to send to: nothing is encoded, nothing is lost
        check_payload(payload, None, who)
        return Payload(payload, tuple(group), round_.collective)
    if residual is not None:
        if residual.numel() != payload.numel():
            raise ValueError(f"{who}: the residual has {residual.numel()} values, the payload {payload.numel()}")
        decay = wire.decay if wire is not None else 1.0
        # a new tensor: never the live weights (β = 1: the plain sum, bitwise as without a decay)
        payload = payload + residual if decay == 1.0 else payload.add(residual, alpha=decay)
    check_payload(payload, codec, who)
    chunks = transport.num_replicas if round_.collective and not codec.gathers else 1  # as the transport encodes
    parts = segments(payload.numel(), transport.slices_per_replica, chunks)
    sent = Payload(payload, tuple(group), round_.collective, codec, tuple(parts))
    if residual is not None:
        lost = sent.loss()
        assert lost is not None
        residual.copy_(lost)
    return sent


def send(payload: Payload, transport: Transport, round_id: RoundId) -> Posted:
    """Posts the group's sum of ``payload`` on ``transport`` as round ``round_id`` (it travels while the
    caller goes on)."""
    if payload.collective:
        pending = transport.start_all_reduce_sum(payload.tensor, payload.codec, round_id)
    else:
        pending = transport.start_group_sum(payload.tensor, payload.group, payload.codec, round_id)
    return Posted(payload.group, payload.collective, payload.tensor, pending)


def post(
    algorithm: OuterAlgorithm, state: OuterState, weights: Tensor, outer_step: int, transport: Transport, *,
    wire: Optional[WireFormat] = None, residual: Optional[Tensor] = None, who: str = "",
    schedule: Optional[Round] = None, round_id: Optional[RoundId] = None,
) -> Posted:
    """Starts round ``outer_step`` for this replica: computes its payload from ``weights`` and posts
    the group's sum on ``transport`` (it travels while the caller goes on). The state is not
    changed until ``algorithm.apply``.

    ``wire``: the wire format (default: float32 as it is). A payload with NaN or inf raises
    :class:`~lightning_loco.wire.codecs.PayloadError` naming ``who`` before anything is sent, whatever
    the format. With a lossy codec and ``residual`` (the error-feedback residual e, updated in
    place), the payload sent is Δ + e and e becomes what the codec loses of it. ``schedule``: the
    round's, when the caller computed it already; ``round_id``: the round's identity on the transport
    (default: outer step ``outer_step``). :func:`prepare` and :func:`send` are its two halves."""
    payload = prepare(algorithm, state, weights, outer_step, transport, wire=wire, residual=residual, who=who,
                      schedule=schedule)
    return send(payload, transport, round_id if round_id is not None else RoundId(outer_step))


def step(
    algorithm: OuterAlgorithm, state: OuterState, weights: Tensor, outer_step: int, transport: Transport,
    wire: Optional[WireFormat] = None, residual: Optional[Tensor] = None,
) -> tuple[Tensor, tuple[int, ...]]:
    """One whole, blocking outer step of this replica over ``transport``: returns the new live
    weights and the group this replica met. ``wire`` and ``residual`` as in :func:`post`."""
    posted = post(algorithm, state, weights, outer_step, transport, wire=wire, residual=residual)
    return algorithm.apply(state, posted.pending.wait(), len(posted.group)), posted.group
