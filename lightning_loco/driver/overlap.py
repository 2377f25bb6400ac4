"""Hiding the outer step's communication behind inner steps: the maths and the bookkeeping.

Round t starts after inner step s = tH: the replica posts its payload (computed from the snapshot
S = θ(s), exactly the synchronous payload), keeps training, and *lands* the round τ inner steps
later. At most one round is in flight. With φ⁺ the new anchor the synchronous outer step computes
from the snapshots, and φ̂ the algorithm's ``local_proxy`` (the same step with every received
quantity replaced by the replica's own), the two merges are:

* ``"predict_correct"`` (default): at s, θ ← φ̂; at s + τ, θ ← θ + (φ⁺ − φ̂). The τ overlapped steps
  are taken near where they land.
* ``"delayed"``: nothing at s; at s + τ, θ ← φ⁺ + (θ − S).

The outer state is committed at the landing in both cases, so the anchors follow the synchronous
formula applied to the snapshots. With τ = 0 nothing is merged: the live weights become φ⁺.

This module is plain tensor maths and timing logic; :mod:`lightning_loco.driver.driver` drives it.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_loco.driver.record import Record
from lightning_loco.transport.base import Pending

MERGES = ("predict_correct", "delayed")
OverlapSteps = Union[int, str]


def check_overlap_steps(overlap_steps: Any) -> None:
    """Raises ``ValueError`` unless ``overlap_steps`` is an integer >= 0 or "auto" (how it meets
    ``sync_every`` and the other options is a rule of :mod:`lightning_loco.replica.options`)."""
    if overlap_steps == "auto":
        return
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or overlap_steps < 0:
        raise ValueError(
            f"overlap_steps must be an integer >= 0 or 'auto', got {overlap_steps!r}. 0 (the default) is the "
            "synchronous outer step."
        )


def auto_cap(sync_every: int, share: float) -> int:
    """The largest τ that ``"auto"`` may choose: the algorithm's ``overlap_share`` of H (H/2 for NoLoCo,
    H/4 otherwise: where our simulation found the loss change small; see docs/algorithms.md)."""
    return math.floor(sync_every * share)


def share_text(share: float) -> str:
    """``H/2`` for a share of ½, ``0.3·H`` for one that is not a unit fraction."""
    inverse = 1 / share if share > 0 else 0
    return f"H/{round(inverse)}" if inverse and abs(inverse - round(inverse)) < 1e-9 else f"{share:g}·H"


@dataclass
class InFlight:
    """One round between its start and its landing, on one replica and for one optimizer."""

    outer_step: int  # t
    start_step: int  # the optimizer's step count when it started (s)
    land_step: int  # s + τ
    group: tuple[int, ...]
    pending: Pending
    reference: Tensor  # φ̂ for "predict_correct", S for "delayed" (float32, outer-state device)
    merge: str
    collective: bool = False  # the round is one all-reduce (its schedule's, computed once when posted)
    posted_at: float = 0.0  # on the driver's clock
    exchange_seconds: Optional[float] = None  # seconds from posting until the exchange was first seen complete
    residual_before: Optional[Tensor] = None  # the error-feedback residual before a round that may be dropped
    record: Record = field(default_factory=Record)  # what is observed of the round (lightning_loco.driver.record)

    def poll(self, now: float) -> None:
        """Notes when the exchange is first seen complete (non-blocking; ``now`` on the driver's clock:
        to within one inner step)."""
        if self.exchange_seconds is None and self.pending.done():
            self.exchange_seconds = now - self.posted_at

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the round: the received sum is awaited first (this only waits
        for the transfer; the model is not touched, so training continues as it would have)."""
        total = self.pending.wait()
        return {
            "outer_step": self.outer_step, "start_step": self.start_step, "land_step": self.land_step,
            "group": list(self.group), "sum": total, "reference": self.reference, "merge": self.merge,
            "collective": self.collective,
        }

    @classmethod
    def from_state_dict(cls, saved: dict[str, Any], transport: Any, device: torch.device, now: float) -> "InFlight":
        """The round :meth:`state_dict` saved, its exchange already complete (``transport.resolved``);
        ``now``: the driver's clock."""
        group = tuple(saved["group"])
        peers = tuple(j for j in group if j != transport.replica)
        return cls(
            outer_step=saved["outer_step"], start_step=saved["start_step"], land_step=saved["land_step"],
            group=group, pending=transport.resolved(saved["sum"].to(device), peers),
            reference=saved["reference"].to(device), merge=saved["merge"],
            collective=bool(saved.get("collective", False)), posted_at=now,
        )


def merge_at_landing(merge: str, live: Tensor, new_anchor: Tensor, reference: Tensor) -> tuple[Tensor, Tensor]:
    """The live weights after the landing, and the correction applied to them (both new tensors).

    ``live`` is θ now, ``new_anchor`` φ⁺, ``reference`` φ̂ (predict_correct) or S (delayed)."""
    if merge == "predict_correct":
        correction = new_anchor - reference  # φ⁺ − φ̂
        return live + correction, correction
    merged = new_anchor + (live - reference)  # φ⁺ + (θ − S)
    return merged, merged - live


class AutoOverlap:
    """Chooses τ for ``overlap_steps="auto"``: the smallest number of inner steps that covers the
    exchange times measured in earlier rounds, at most ``cap``.

    The first round runs synchronously (τ = 0) and measures the exchange. Afterwards an overlapped
    round measures its exchange by polling at every inner step (so to within one step) or, when the
    landing had to wait, by when the wait ended. Inner-step times are the intervals between a
    replica's optimizer steps, outer-step work excluded; medians of recent values keep validation
    passes and stragglers from steering τ. Each replica chooses its own τ from its own timings.
    """

    def __init__(self, cap: int, history: int = 5) -> None:
        self.cap = cap
        self.exchanges: deque[float] = deque(maxlen=history)
        self.steps: deque[float] = deque(maxlen=4 * history)
        self.needed: Optional[int] = None  # the τ that would hide the last estimate, uncapped
        self.warned = False

    def observe_exchange(self, seconds: float) -> None:
        self.exchanges.append(seconds)

    def observe_step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def choose(self) -> int:
        if not self.exchanges or not self.steps or self.cap < 1:
            return 0
        step = max(statistics.median(self.steps), 1e-9)
        self.needed = max(1, math.ceil(statistics.median(self.exchanges) / step))
        return min(self.needed, self.cap)

    @property
    def cannot_hide(self) -> bool:
        return self.needed is not None and self.needed > self.cap


def choose_overlap(auto: AutoOverlap, agree: Optional[Callable[[int], int]], label: str, share: float,
                   stride: int) -> int:
    """τ for the next round under ``overlap_steps="auto"``: ``auto``'s choice, agreed over the replica's
    ranks by ``agree`` when given; warns once when the cap (the algorithm's ``share`` of ``stride``, the
    inner steps between rounds) cannot hide the exchange."""
    tau = auto.choose()
    if agree is not None:
        tau = agree(tau)
    if auto.cannot_hide and not auto.warned:
        auto.warned = True
        warnings.warn(
            f"{label}: overlap_steps='auto' needs about {auto.needed} inner steps to hide the outer "
            f"step's exchange but is capped at {auto.cap} "
            f"({share_text(share)} with H={stride}); the rest of "
            "the exchange is waited for at each landing. A larger sync_every hides more.",
            stacklevel=4,
        )
    return tau

