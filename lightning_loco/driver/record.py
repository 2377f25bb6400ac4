"""A round's record, kept apart from the round: what is observed of it, and the report made of it.

The rounds themselves (:mod:`lightning_loco.driver.rounds`, :mod:`lightning_loco.driver.overlap`) only
compute, move and merge weights. What a finished round's
:class:`~lightning_loco.driver.reports.OuterStepReport` says is gathered by a :class:`Record`, at the
points of the round the driver (:mod:`lightning_loco.driver.driver`) shows it:

1. :meth:`Record.before_post`: the weights the round starts from (the pseudo-gradient's norm);
2. :meth:`Record.sending`: the payload, checked and not yet sent (the payload as sent, the codec's loss);
3. :meth:`Record.received`: the group's sum, before the algorithm applies it (the peer distance);
4. :meth:`Record.report`: what the landing did (:class:`Landed`): the report.

Norms and the peer distance are taken only when norms are tracked (the monitor asks for them: one copy
of the anchor a round); the codec's loss also when error feedback computed it anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_loco.driver.pacing import Phase, compute_share
from lightning_loco.driver.reports import OuterStepReport
from lightning_loco.driver.rounds import Payload
from lightning_loco.transport.base import Pending


def peer_distance(own: Tensor, group_sum: Tensor, group_size: int) -> Optional[float]:
    """‖own payload − the group's mean payload‖: how far this replica stood from the replicas it just
    met, known after every exchange at no extra cost. ``None`` for a replica that met nobody."""
    if group_size < 2:
        return None
    mean = group_sum.to(own.device) / group_size
    return torch.linalg.vector_norm(own - mean).item()


def norm(x: Tensor) -> float:
    return torch.linalg.vector_norm(x).item()


@dataclass(frozen=True)
class Landed:
    """What a round's landing did, as the driver saw it (times on the driver's clock)."""

    optimizer_index: int
    fragment: int
    outer_step: int  # t
    inner_step: int  # the optimizer's step count at the landing
    group: tuple[int, ...]  # replica indices, this replica included
    pending: Pending  # the exchange, complete: its bytes, and whether it finished alone
    overlap_steps: int  # τ: inner steps between the round's start and its landing
    change: Optional[Tensor]  # overlapped rounds: the change merged into the live weights
    exchange_seconds: Optional[float]  # overlapped rounds: posting until the exchange completed
    comm_seconds: float  # the landing's wait for the exchange
    landed_at: float  # when the landing began
    done_at: float  # when it was done (before the report)
    final: bool  # landed as the end of training


@dataclass
class Record:
    """What is observed of one round between its start and its landing."""

    track_norms: bool = False
    anchor_before: Optional[Tensor] = None  # kept only when norms are tracked
    pseudo_gradient_norm: Optional[float] = None  # ‖θ − anchor‖ before the step
    own_payload: Optional[Tensor] = None  # the payload as sent, kept only when norms are tracked
    compression_error_norm: Optional[float] = None  # ‖D(Q(x)) − x‖ of the payload x sent (lossy wire formats)
    peer_distance: Optional[float] = None
    start_seconds: float = 0.0  # time the start took from training (posting, prediction)

    @classmethod
    def before_post(cls, track_norms: bool, anchor: Tensor, weights: Tensor) -> Record:
        """The record of a round about to start from ``weights``, with the outer state's ``anchor``."""
        if not track_norms:
            return cls()
        before = anchor.clone()
        return cls(True, before, norm(weights - before))

    def sending(self, payload: Payload) -> None:
        """The payload, before the transport has it (an all-reduce sums into it in place)."""
        if self.track_norms:
            self.own_payload = payload.tensor.clone() if payload.collective else payload.tensor
        lost = payload.loss() if self.track_norms else payload.lost
        if lost is not None:
            self.compression_error_norm = norm(lost)

    def received(self, total: Tensor, group_size: int) -> None:
        """The group's sum, before the algorithm applies it."""
        if self.own_payload is not None:
            self.peer_distance = peer_distance(self.own_payload, total, group_size)

    def report(self, landed: Landed, anchor: Tensor, phase: Phase, replica: int,
               peer_ids: tuple[str, ...]) -> OuterStepReport:
        """The round's report: ``anchor`` is the outer state's after the landing, ``phase`` the inner phase
        that led to the round, ``replica`` this replica's index and ``peer_ids`` its peers' names."""
        update_norm = None if self.anchor_before is None else norm(anchor - self.anchor_before)
        phase_steps, compute = phase.ended if phase.ended is not None else (None, None)
        pending, done, began = landed.pending, landed.done_at, landed.landed_at
        return OuterStepReport(
            optimizer_index=landed.optimizer_index, outer_step=landed.outer_step, inner_step=landed.inner_step,
            peers=tuple(j for j in landed.group if j != replica),
            bytes_sent=pending.nbytes, bytes_received=pending.nbytes, comm_seconds=landed.comm_seconds,
            seconds=self.start_seconds + done - began, phase_steps=phase_steps, compute_seconds=compute,
            compute_share=compute_share(compute, phase.spent + done - began),
            pseudo_gradient_norm=self.pseudo_gradient_norm, update_norm=update_norm,
            overlap_steps=landed.overlap_steps, exchange_seconds=landed.exchange_seconds,
            correction_norm=None if landed.change is None else norm(landed.change), peer_distance=self.peer_distance,
            final=landed.final, compression_error_norm=self.compression_error_norm,
            peer_ids=peer_ids, fragment=landed.fragment, alone=pending.alone,
        )
