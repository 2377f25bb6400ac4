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

The driver (:mod:`lightning_loco.driver.driver`) calls :func:`post` when a round is due and, at the landing,
``pending.wait()`` and ``algorithm.apply``. :func:`step` is the two together, blocking, for studies
and benchmarks that time one outer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.algorithms.schedules import Round
from lightning_loco.transport.base import Pending, RoundId, Transport
from lightning_loco.wire.codecs import WireFormat, check_payload, roundtrip_segments, segments


@dataclass
class Posted:
    """A round this replica has posted: its group, its payload and the exchange in flight."""

    group: tuple[int, ...]
    collective: bool  # an all-reduce, which sums in place into ``payload``
    payload: Tensor
    pending: Pending
    own: Optional[Tensor] = None  # the payload as sent, when asked for (``post(keep_own=True)``)
    compression_error: Optional[float] = None  # ‖D(Q(x)) − x‖ of the payload x sent (lossy wire formats)


def post(
    algorithm: OuterAlgorithm, state: OuterState, weights: Tensor, outer_step: int, transport: Transport,
    keep_own: bool = False, wire: Optional[WireFormat] = None, residual: Optional[Tensor] = None, who: str = "",
    measure_error: bool = False, schedule: Optional[Round] = None, round_id: Optional[RoundId] = None,
) -> Posted:
    """Starts round ``outer_step`` for this replica: computes its payload from ``weights`` and posts
    the group's sum on ``transport`` (it travels while the caller goes on). The state is not
    changed until ``algorithm.apply``. With ``keep_own``, ``Posted.own`` is this replica's payload as
    sent (a copy taken before an all-reduce starts summing into it).

    ``wire``: the wire format (default: float32 as it is). A payload with NaN or inf raises
    :class:`~lightning_loco.wire.codecs.PayloadError` naming ``who`` before anything is sent, whatever
    the format. With a lossy codec and ``residual`` (the error-feedback residual e, updated in
    place), the payload sent is Δ + e and e becomes what the codec loses of it.
    ``Posted.compression_error`` is ‖D(Q(x)) − x‖ of the payload x sent, known with a residual and
    computed with ``measure_error``. ``schedule``: the round's, when the caller computed it already;
    ``round_id``: the round's identity on the transport (default: outer step ``outer_step``)."""
    round_ = schedule if schedule is not None else algorithm.schedule(outer_step, transport.num_replicas)
    round_id = round_id if round_id is not None else RoundId(outer_step)
    group = round_.group_of(transport.replica)
    who = who or f"Replica {transport.replica}, outer step {outer_step}"
    payload = algorithm.payload(state, weights)
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
        parts = segments(payload.numel(), transport.slices_per_replica,
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
    if round_.collective:
        pending = transport.start_all_reduce_sum(payload, codec, round_id)
    else:
        pending = transport.start_group_sum(payload, group, codec, round_id)
    return Posted(tuple(group), round_.collective, payload, pending, own, error)


def step(
    algorithm: OuterAlgorithm, state: OuterState, weights: Tensor, outer_step: int, transport: Transport,
    wire: Optional[WireFormat] = None, residual: Optional[Tensor] = None,
) -> tuple[Tensor, tuple[int, ...]]:
    """One whole, blocking outer step of this replica over ``transport``: returns the new live
    weights and the group this replica met. ``wire`` and ``residual`` as in :func:`post`."""
    posted = post(algorithm, state, weights, outer_step, transport, wire=wire, residual=residual)
    return algorithm.apply(state, posted.pending.wait(), len(posted.group)), posted.group
