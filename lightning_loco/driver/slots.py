"""One inner optimizer's outer state on this replica, and what a checkpoint keeps of it.

An :class:`OuterSlot` holds the optimizer's flat parameters, the algorithm's outer state, the step
counters, the inner phase (:mod:`lightning_loco.driver.pacing`), a round in flight
(:mod:`lightning_loco.driver.overlap`), the error-feedback residual and, after a final landing, the outer
step's own live weights. The driver
(:mod:`lightning_loco.driver.driver`) keeps one per optimizer; ``state_dict``/``load_state_dict`` are the
tensors and plain values a replica's checkpoint file holds.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.driver.fragments import check_saved
from lightning_loco.driver.overlap import AutoOverlap, InFlight
from lightning_loco.driver.pacing import Phase


@dataclass
class OuterSlot:
    """The outer state of one inner optimizer on this replica, and its step counters."""

    flat: FlatParameters
    state: OuterState
    inner_steps: int = 0  # inner steps counted (an fp16 step the scaler skipped counts too)
    outer_steps: int = 0  # rounds started
    in_flight: Optional[InFlight] = None  # a round started and not landed yet (overlap only)
    auto: Optional[AutoOverlap] = None  # chooses τ when overlap_steps="auto"
    last_step_end: Optional[float] = None  # "auto" only: when the previous inner step was counted
    # After a round landed as the end of training: the live weights its plain outer step gave, which
    # training that goes on after all (a resumed checkpoint) starts from.
    outer_weights: Optional[Tensor] = None
    # Error feedback (lossy wire formats on pseudo-gradients): what the codec has lost of the payloads
    # sent so far, added to the next one. Outer state: saved and restored with the rest.
    residual: Optional[Tensor] = None
    phase: Phase = field(default_factory=Phase)  # inner steps and compute since the previous round
    # Streaming fragments (lightning_loco.driver.fragments): the algorithm that runs this slot (its own peer
    # schedule), which of the optimizer's F fragments it is, and the inner step of its first round.
    algorithm: Optional[OuterAlgorithm] = None
    fragment: int = 0
    fragments: int = 1
    offset: int = 0

    def state_dict(self, now: float) -> dict[str, Any]:
        """Counters, the inner phase so far (``now`` on the driver's clock), outer state, a round in
        flight (its received sum is awaited first, not landed: training goes on exactly as it would
        have) and, after a final landing, the outer step's live weights (so that a resumed run
        continues as a longer run would have)."""
        out: dict[str, Any] = {
            "numel": self.flat.numel, "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
            "in_flight": self.in_flight.state_dict() if self.in_flight is not None else None,
            "state": self.state.state_dict(), "phase": self.phase.state_dict(now),
        }
        if self.outer_weights is not None:
            out["outer_weights"] = self.outer_weights
        if self.residual is not None:
            out["residual"] = self.residual
        if self.fragments > 1:
            out["fragments"] = self.fragments
        return out

    def load_state_dict(self, entry: dict[str, Any], transport: Any, error_feedback: bool, now: float) -> None:
        """Restores what :meth:`state_dict` saved; ``transport`` resolves a saved round in flight, and
        ``error_feedback`` says whether the residual is kept (saved without one: from zero)."""
        device = self.state.anchor.device
        self.state.load_state_dict(entry["state"])
        self.inner_steps, self.outer_steps = entry["inner_steps"], entry["outer_steps"]
        outer_weights = entry.get("outer_weights")  # saved after a final landing: restored if training goes on
        self.outer_weights = None if outer_weights is None else outer_weights.to(device).clone()
        residual = entry.get("residual")
        self.residual = residual.to(device).clone() if error_feedback and residual is not None else None
        self.phase.load_state_dict(entry.get("phase"), self.inner_steps, now)  # its compute so far counts
        flight = entry.get("in_flight")
        self.in_flight = None if flight is None else InFlight.from_state_dict(flight, transport, device, now)

    def residual_for_round(self, algorithm: OuterAlgorithm, error_feedback: bool, droppable: bool) -> Optional[Tensor]:
        """Before a round of ``algorithm``: with ``error_feedback``, the residual starts at zero if it has not
        yet. Returns a copy of it for a round that may be dropped (``droppable``: restored then), else None."""
        if error_feedback and self.residual is None:
            self.residual = torch.zeros(algorithm.payload_numel(self.state), device=self.state.anchor.device)
        return self.residual.clone() if self.residual is not None and droppable else None

    def drop(self, flight: InFlight) -> None:
        """Drops ``flight``, a collective round the transport finished alone: applied, it would move this
        replica's anchor apart from the others'. The outer state stays as it was, the error-feedback
        residual as it was before the round (the dropped payload's loss is not kept), and the next
        round's payload covers both stretches."""
        if self.residual is not None and flight.residual_before is not None:
            self.residual.copy_(flight.residual_before)

    def restore_outer_weights(self) -> bool:
        """After a final landing, sets the live weights to the outer step's own again (training goes on).
        Returns whether there were any."""
        if self.outer_weights is None:
            return False
        self.flat.scatter(self.outer_weights)
        self.outer_weights = None
        return True

    def abandon(self, timeout: float, label: str) -> Optional[threading.Thread]:
        """Drops the round in flight, if any, after giving its exchange up to ``timeout`` seconds (a warning
        naming ``label`` says so when it did not finish). Returns the thread still waiting on it, if one is."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return None
        if not flight.pending.abandon(timeout=timeout):
            warnings.warn(
                f"{label}: training stopped while outer step {flight.outer_step} was in flight and its "
                "exchange did not finish; the round was dropped.",
                stacklevel=3,
            )
        watcher = flight.pending.watcher
        return watcher if watcher is not None and watcher.is_alive() else None


def load_slots(slots: Sequence[OuterSlot], saved: Sequence[dict[str, Any]], transport: Any, error_feedback: bool,
               clock: Callable[[], float]) -> None:
    """Restores every slot from the entries their ``state_dict`` saved, in order (nothing when ``saved``
    is empty: saved before training started, fresh outer state). Raises ``ValueError`` when the
    optimizers' parameters or the number of fragments do not match what was saved."""
    if not saved:
        return
    check_saved(saved, slots[0].fragments if slots else 1)
    if len(saved) != len(slots) or any(s["numel"] != slot.flat.numel for s, slot in zip(saved, slots)):
        raise ValueError(
            f"The checkpoint's outer state covers {[s['numel'] for s in saved]} parameters per optimizer, "
            f"this model's optimizers {[slot.flat.numel for slot in slots]}: the model or its "
            "optimizers changed. Start a new run from the checkpoint's consensus model instead."
        )
    for slot, entry in zip(slots, saved):
        slot.load_state_dict(entry, transport, error_feedback, clock())
