"""What the driver reports of each finished round.

An :class:`OuterStepReport` is left by every round that landed on this replica (one per optimizer,
fragment and round): its peers, bytes, the time it cost training, the inner phase that led to it (its
inner steps H_i, its compute, and the share of wall time that compute had), and, when norms are
tracked (the monitor asks for them), the norms and the peer distance. :mod:`lightning_loco.driver.record`
builds them; :mod:`lightning_loco.trainer.monitoring` logs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class OuterStepReport:
    """What happened at one finished round of one optimizer on this replica."""

    optimizer_index: int
    outer_step: int  # index t of the round
    inner_step: int  # this optimizer's step count when it finished
    peers: tuple[int, ...]
    bytes_sent: int
    bytes_received: int
    comm_seconds: float  # time blocked waiting for the exchange
    seconds: float  # time the round took from training (start and landing)
    pseudo_gradient_norm: Optional[float] = None  # ‖θ − anchor‖ before the step (when norms are tracked)
    update_norm: Optional[float] = None  # ‖anchor after − anchor before‖
    overlap_steps: int = 0  # τ: inner steps between the start of the round and its landing
    exchange_seconds: Optional[float] = None  # overlapped rounds: posting until the exchange completed
    correction_norm: Optional[float] = None  # overlapped rounds: ‖change applied to θ at the landing‖
    peer_distance: Optional[float] = None  # ‖own payload − group's mean payload‖: a free, local spread signal
    final: bool = False  # landed as the end of training: live weights without the momentum extrapolation
    compression_error_norm: Optional[float] = None  # ‖D(Q(x)) − x‖ of this replica's payload x (lossy wire formats)
    # The peers' names, in the order of ``peers``: replica ids for elastic replicas (``peers`` are indices
    # into the current membership, which changes), the index as text in the static launch.
    peer_ids: tuple[str, ...] = ()
    # The inner phase that ended with this round's start, on this replica's own clock (lightning_loco.driver.pacing):
    phase_steps: Optional[int] = None  # H_i: its inner steps (H unless sync_seconds paces the rounds)
    compute_seconds: Optional[float] = None  # its compute: wall time since the previous round, rounds' time left out
    compute_share: Optional[float] = None  # compute_seconds / (compute_seconds + seconds): 1 when nobody is waited for
    fragment: int = 0  # which of the optimizer's fragments the round moved (lightning_loco.driver.fragments)
    # The transport finished the round without the peers the schedule gave it (an elastic replica whose
    # exchange failed or whose partner was late): ``peers`` are whom it was to meet, and it met nobody.
    alone: bool = False
    # Elastic replicas: memberships whose process group this replica could not set up so far (a transient
    # failure of the rendezvous: their rounds were taken alone); None in the static launch.
    membership_errors: Optional[int] = None

