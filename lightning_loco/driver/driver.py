"""The outer-step driver: when rounds start and land, on whatever transport. No Lightning here.

``OuterStepDriver`` keeps one :class:`OuterSlot` per inner optimizer (its flat parameters, its
outer state, its step counters and its round in flight) and is told of every real inner step with
``after_inner_step(index)``. Every ``sync_every``-th step of an optimizer (or, with ``sync_seconds``,
once this replica's inner phase is about that long: :mod:`lightning_loco.driver.pacing`) it starts round t
of the algorithm on that optimizer's parameters:

* τ = 0: the round is posted and waited for at once, and the live weights become the algorithm's;
* τ > 0 (``overlap_steps``): the round is posted and training goes on; it lands τ steps later and
  is merged into the live weights (:mod:`lightning_loco.driver.overlap`).

With ``fragments=F`` each of the F fragments of an optimizer's parameters is a slot of its own.

The round that ends training can land without the outer step's momentum extrapolation
(``final_outer_step="average"``): told by ``after_inner_step(index, last=True)`` or by ``land_all``
(the end of training) that nothing will follow, the driver updates the outer state as usual and
sets the live weights to the algorithm's ``final_weights``, keeping the outer step's own live weights
aside in case training goes on after all (``restore_outer_weights``; checkpoints keep them too).

Whether a step is the last one is the caller's to say (``last``, ``land_all``); the driver decides it
only where its own counters set the run's end (``ends_by_driver_steps``: ``last_step``, under
``sync_seconds`` or for a plug-in that changes the counters).

Each finished round leaves an :class:`OuterStepReport`, made by the round's record
(:mod:`lightning_loco.driver.record`), not by the round. The Lightning strategies
(:mod:`lightning_loco.trainer`) call the driver from their hooks; tests drive it directly over
the in-process transport (:mod:`lightning_loco.transport.in_process`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.algorithms.step_weighted import with_merge
from lightning_loco.driver import fragments as streaming
from lightning_loco.driver import rounds
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.driver.overlap import AutoOverlap, InFlight, auto_cap, choose_overlap, merge_at_landing
from lightning_loco.driver.pacing import AUTO, AutoSeconds, Pacing, SharedStepTimes, StepTimes
from lightning_loco.driver.plugins import DriverPlugin, Landing, Outcome
from lightning_loco.driver.record import Landed, Record
from lightning_loco.driver.reports import OuterStepReport
from lightning_loco.driver.slots import OuterSlot, load_slots
from lightning_loco.replica.options import Options
from lightning_loco.transport.base import RoundId, Transport
from lightning_loco.wire.codecs import WireFormat


class OuterStepDriver:
    """Runs an outer-step algorithm over a transport for one replica.

    Args:
        options: the run's options (:class:`~lightning_loco.replica.options.Options`, checked when built): the
            algorithm and H, overlap (τ or "auto", and the merge), fragments, pacing (``sync_seconds``
            and its merge), the wire format and ``final_outer_step``. The driver reads those; the rest
            are the strategies'.
        transport: moves payloads between replicas (torch.distributed, elastic or in-process).
        label: how warnings name this replica.
        plugin: told around rounds (:mod:`lightning_loco.driver.plugins`); default: none.
        clock: the driver's one clock (injectable for tests): the inner phases that pace rounds under
            ``sync_seconds``, the exchange and step times that ``overlap_steps="auto"`` reads, and the
            reports' seconds.
        agree_overlap: with replicas of several ranks, makes the ranks of a replica agree on τ
            (they all-gather at the landing); given τ, returns the agreed τ.
        agree_seconds: with ``sync_seconds`` and replicas of several ranks, makes the ranks of a replica
            agree on their phase's seconds (given this rank's, returns the largest): rounds and
            ``nominal_step`` are then the same on all of them.
        step_times: with ``sync_seconds="auto"``, where replicas tell each other their step times
            (:class:`~lightning_loco.driver.pacing.StepTimes`; default: a board of this driver alone).

    ``final_outer_step="average"`` is the default, as on the strategies and the simulator. With a lossy
    wire format and error feedback every slot keeps a residual.
    """

    def __init__(self, options: Options, transport: Transport, *, label: str = "",
                 plugin: Optional[DriverPlugin] = None, clock: Callable[[], float] = time.perf_counter,
                 agree_overlap: Optional[Callable[[int], int]] = None,
                 agree_seconds: Optional[Callable[[float], float]] = None,
                 step_times: Optional[StepTimes] = None) -> None:
        options.algorithm.check_num_replicas(transport.num_replicas)
        self.options = options
        wire = options.wire_format
        self.algorithm = with_merge(options.algorithm, options.merge)
        self.transport, self.sync_every, self.fragments = transport, options.sync_every, options.fragments
        self.wire: Optional[WireFormat] = wire if wire.lossy else None
        self.error_feedback = self.wire is not None and self.wire.error_feedback
        self.overlap_steps, self.overlap_merge = options.overlap_steps, options.overlap_merge
        self.agree_overlap = agree_overlap
        self.final_outer_step, self.label = options.final_outer_step, label or f"Replica {transport.replica}"
        self.slots: list[OuterSlot] = []  # every optimizer's F fragments, in order (F = 1: one per optimizer)
        self.optimizer_slots: list[list[OuterSlot]] = []  # optimizer index → its fragments' slots
        self.reports: list[OuterStepReport] = []
        self.rounds_started: list[tuple[int, int]] = []  # (optimizer index, t) as fragment 0's rounds start
        self.track_norms, self.clock = False, clock  # track_norms: norms and peer distance, one anchor copy a round
        sync_seconds = options.sync_seconds
        auto = None
        if sync_seconds == AUTO:
            auto = AutoSeconds(self.sync_every, transport.replica, step_times or SharedStepTimes())
        self.pacing = None
        if sync_seconds is not None:
            self.pacing = Pacing(self.sync_every, sync_seconds, clock, agree_seconds, auto)
        self.plugin = plugin if plugin is not None else DriverPlugin()
        self.plugin.attach(self)

    @classmethod
    def of(cls, algorithm: OuterAlgorithm, transport: Transport, sync_every: int, *, label: str = "",
           plugin: Optional[DriverPlugin] = None, clock: Callable[[], float] = time.perf_counter,
           agree_overlap: Optional[Callable[[int], int]] = None,
           agree_seconds: Optional[Callable[[float], float]] = None, step_times: Optional[StepTimes] = None,
           **options: Any) -> OuterStepDriver:
        """A driver of ``algorithm`` every ``sync_every`` steps, with ``options`` as the strategies take them
        (``overlap_steps``, ``fragments``, ``pacing``, ``wire``, ...: :meth:`Options.build`)."""
        return cls(Options.build(algorithm, sync_every, **options), transport, label=label, plugin=plugin,
                   clock=clock, agree_overlap=agree_overlap, agree_seconds=agree_seconds, step_times=step_times)

    def add(self, flat: FlatParameters) -> OuterSlot:
        """Adds an optimizer's parameters (as F fragments: :func:`lightning_loco.driver.fragments.layout`); the
        outer state starts at their current values. Returns the slot of its first fragment."""
        F, H = self.fragments, self.sync_every
        self.optimizer_slots.append([])
        for f, part in enumerate(streaming.split(flat, F)):
            algorithm = streaming.fragment_algorithm(self.algorithm, f)
            auto = AutoOverlap(auto_cap(H // F, algorithm.overlap_share)) if self.overlap_steps == "auto" else None
            slot = OuterSlot(flat=part, state=algorithm.init_state(part.gather(), part.shapes), auto=auto,
                             algorithm=algorithm, fragment=f, fragments=F, offset=streaming.offset(f, H, F))
            slot.phase.restart(self.clock())
            self.slots.append(slot)
            self.optimizer_slots[-1].append(slot)
        return self.optimizer_slots[-1][0]

    def params_of(self, index: int) -> list[torch.Tensor]:
        """Optimizer ``index``'s parameters, every fragment's, in order."""
        return [p for slot in self.optimizer_slots[index] for p in slot.flat.params]

    # ------------------------------------------------------------------ the inner-step hook

    def round_due(self, index: int) -> bool:
        """Whether the next inner step of optimizer ``index`` starts a round (with ``sync_seconds``:
        decided on the clock now, so call it once that step's compute is done)."""
        return any(self._due(slot, slot.inner_steps + 1) for slot in self.optimizer_slots[index])

    def _due(self, slot: OuterSlot, steps: int) -> bool:
        if self.pacing is None:
            return (steps - slot.offset) % self.sync_every == 0
        return self.pacing.due(slot.phase, slot.outer_steps, steps)

    @property
    def ends_by_driver_steps(self) -> bool:
        """Whether the driver, not Lightning's count of steps, says when training ends: under
        ``sync_seconds`` (the run ends on a round) or for a plug-in that changes the counters."""
        return self.pacing is not None or self.plugin.ends_by_driver_steps

    def last_step(self, index: int, max_steps: int) -> bool:
        """Whether training ends after the next inner step of optimizer ``index``, for a run of
        ``max_steps``: with ``sync_seconds`` when it starts round ⌈max_steps / H⌉ − 1 (the same round
        on every replica); otherwise when the driver's count reaches ``max_steps``."""
        slot = self.optimizer_slots[index][0]
        if self.pacing is None:
            return slot.inner_steps + 1 >= max_steps
        if self.pacing.max_steps != max_steps:
            self.pacing.end_at(max_steps)
            slot.phase.decision = None  # decided without the run's end: again
        return self.pacing.last(slot.phase, slot.outer_steps, slot.inner_steps + 1)

    def nominal_step(self, index: int = 0) -> float:
        """Progress in nominal inner steps (what a learning-rate schedule should follow): the count of
        inner steps, or with ``sync_seconds`` t·H plus the share of the current phase done."""
        slot = self.optimizer_slots[index][0]
        if self.pacing is None:
            return float(slot.inner_steps)
        return self.pacing.nominal_step(slot.phase, slot.outer_steps, slot.inner_steps)

    def after_inner_step(self, index: int, last: bool = False) -> None:
        """Counts one inner step of optimizer ``index``; lands and starts rounds when they are due.
        ``last``: training ends after this step, so a round landing now is the final one (with F > 1,
        every fragment not in flight starts a round now, so that every fragment ends on a round)."""
        for slot in self.optimizer_slots[index]:
            self._after_step(index, slot, last)

    def _after_step(self, index: int, slot: OuterSlot, last: bool) -> None:
        slot.inner_steps += 1
        slot.outer_weights = None  # training went on after a landing taken for the last one
        final = last and self.final_outer_step == "average"
        if slot.auto is not None and slot.last_step_end is not None:
            slot.auto.observe_step(self.clock() - slot.last_step_end)
        due = self._due(slot, slot.inner_steps)
        flush = last and self.fragments > 1 and not due  # F > 1: a round of every fragment at the end
        if slot.in_flight is not None:
            slot.in_flight.poll(self.clock())
            if slot.inner_steps >= slot.in_flight.land_step:
                self._land(index, slot, final and not flush)
        if due or (flush and slot.in_flight is None):
            tau = self._overlap_for(slot)
            self._start(index, slot, tau)
            if tau == 0:
                self._land(index, slot, final)
            slot.phase.restart(self.clock())
        if slot.auto is not None:
            slot.last_step_end = self.clock()

    def _overlap_for(self, slot: OuterSlot) -> int:
        if slot.auto is None:
            return int(self.overlap_steps)
        return choose_overlap(slot.auto, self.agree_overlap, self.label, self.algorithm.overlap_share,
                              self.sync_every // self.fragments)

    # ------------------------------------------------------------------ rounds

    def _start(self, index: int, slot: OuterSlot, tau: int) -> None:
        """Posts round t. With τ > 0 the live weights become the local prediction (predict_correct)
        and training goes on; the round lands ``tau`` steps later."""
        algorithm, t = slot.algorithm or self.algorithm, slot.outer_steps
        part = f", fragment {slot.fragment}" if self.fragments > 1 else ""
        ended = self.clock()
        algorithm.phase_ended(slot.state, slot.phase.end(slot.inner_steps, ended))  # H_i, for merge="steps"
        if self.pacing is not None:
            self.pacing.phase_ended(slot.phase)  # sync_seconds="auto": the next estimate of T
        schedule = algorithm.schedule(t, self.transport.num_replicas)  # the round's groups, once
        self.plugin.before_round(index, t, schedule)
        if slot.fragment == 0:  # one entry per H steps and optimizer, as with F = 1
            self.rounds_started.append((index, t))
        weights = slot.flat.gather()  # the snapshot S
        record = Record.before_post(self.track_norms, slot.state.anchor, weights)
        merge = self.overlap_merge if tau else "none"
        snapshot = weights
        if tau and schedule.collective:
            snapshot = weights.clone()  # an all-reduce sums its payload in place, and θ may be it: keep S apart
        residual_before = slot.residual_for_round(  # a collective round this transport finishes alone is dropped
            algorithm, self.error_feedback, droppable=schedule.collective and self.transport.may_go_alone)
        payload = rounds.prepare(algorithm, slot.state, weights, t, self.transport, wire=self.wire,
                                 residual=slot.residual, who=f"{self.label}, optimizer {index}{part}, outer step {t}",
                                 schedule=schedule)
        record.sending(payload)
        posted = rounds.send(payload, self.transport, RoundId(t, optimizer=index, fragment=slot.fragment))
        posted_at = self.clock()
        if tau:
            posted.pending.watch()  # so that polls see when the transfer is done
        reference = snapshot
        if merge == "predict_correct":
            reference = algorithm.local_proxy(slot.state, snapshot, len(posted.group))  # φ̂, while the bytes travel
            slot.flat.scatter(reference)
        slot.in_flight = InFlight(
            outer_step=t, start_step=slot.inner_steps, land_step=slot.inner_steps + tau, group=posted.group,
            pending=posted.pending, reference=reference, merge=merge, collective=posted.collective,
            posted_at=posted_at, residual_before=residual_before, record=record,
        )
        slot.outer_steps += 1
        slot.phase.spent = record.start_seconds = self.clock() - ended

    def _land(self, index: int, slot: OuterSlot, final: bool = False) -> None:
        """Completes the round in flight: waits for the exchange if it is still running, commits the
        outer state, and sets (τ = 0) or merges (τ > 0) the live weights. ``final``: the merge takes
        ``algorithm.final_weights`` in place of the new anchor, and the outer step's own live weights
        are kept in ``slot.outer_weights``. The round's record makes its report."""
        flight, slot.in_flight = slot.in_flight, None
        assert flight is not None
        landed = self.clock()
        pending, algorithm, size = flight.pending, slot.algorithm or self.algorithm, len(flight.group)
        total = pending.wait()
        waited = self.clock()
        if pending.alone and size > 1 and flight.collective:  # finished alone, a collective round is dropped
            slot.drop(flight)
            self.plugin.after_landing(Landing(index, flight.outer_step, flight.group, Outcome.DROPPED, final))
            return
        flight.record.received(total, size)
        final_weights = algorithm.final_weights(slot.state, total, size) if final else None
        new_anchor = algorithm.apply(slot.state, total, size)
        exchange = change = None
        if flight.merge == "none":
            if final_weights is not None:
                slot.outer_weights = new_anchor.clone()
            slot.flat.scatter(new_anchor if final_weights is None else final_weights)
        else:
            live = slot.flat.gather()
            merged, change = merge_at_landing(flight.merge, live, new_anchor, flight.reference)
            if final_weights is not None:  # the same merge, with the final weights for the new anchor
                slot.outer_weights = merged
                merged, change = merge_at_landing(flight.merge, live, final_weights, flight.reference)
            slot.flat.scatter(merged)
            exchange = flight.exchange_seconds if flight.exchange_seconds is not None else waited - flight.posted_at
        if slot.auto is not None:
            slot.auto.observe_exchange(exchange if exchange is not None else waited - flight.posted_at)
        landing = Landed(
            optimizer_index=index, fragment=slot.fragment, outer_step=flight.outer_step, inner_step=slot.inner_steps,
            group=flight.group, pending=pending, overlap_steps=slot.inner_steps - flight.start_step,
            change=change, exchange_seconds=exchange, comm_seconds=waited - landed, landed_at=landed,
            done_at=self.clock(), final=final_weights is not None,
        )
        self.reports.append(flight.record.report(landing, slot.state.anchor, slot.phase, self.transport.replica,
                                                 self.plugin.peer_ids(flight.group)))
        if flight.merge != "none":  # overlapped: the landing's time is not the next phase's compute
            slot.phase.excluded += self.clock() - landed
        outcome = Outcome.ALONE if pending.alone else Outcome.EXCHANGED
        self.plugin.after_landing(Landing(index, flight.outer_step, flight.group, outcome, final))

    def before_training(self) -> None:
        """Called once before the first inner step, after a resumed state is loaded (the plug-in's turn:
        an elastic replica takes up its first membership here)."""
        self.plugin.before_training()

    def close(self) -> None:
        """Training stopped: the plug-in lets go of what it holds (an elastic replica leaves its membership)."""
        self.plugin.close()

    def land_all(self) -> None:
        """Lands every round in flight now (the end of training): with ``final_outer_step="average"``
        as final rounds."""
        final = self.final_outer_step == "average"
        for index, slot in enumerate(self.slots):
            if slot.in_flight is not None:
                self._land(index, slot, final)

    def restore_outer_weights(self) -> bool:
        """Training goes on after rounds that landed as final (a resumed checkpoint, or an end that did
        not come): their live weights become the outer step's again. Returns whether any did."""
        return any([slot.restore_outer_weights() for slot in self.slots])  # a list: every slot's, restored

    def abandon_all(self, timeout: float) -> list[threading.Thread]:
        """Drops every round in flight after giving its exchange up to ``timeout`` seconds (training
        stopped). Returns the threads still waiting on an exchange: their process group must outlive
        them."""
        lingering = []
        for slot in self.slots:  # a loop, not a comprehension: the warning names abandon_all's caller
            thread = slot.abandon(timeout, self.label)
            if thread is not None:
                lingering.append(thread)
        return lingering

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [slot.state_dict(now) for slot in self.slots]

    def load_state_dict(self, saved: Sequence[dict[str, Any]]) -> None:
        """Restores what :meth:`state_dict` saved (:func:`lightning_loco.driver.slots.load_slots`): counters,
        outer state, rounds in flight and the outer step's live weights after a final landing (applied
        by :meth:`restore_outer_weights` once training goes on). Raises ``ValueError`` when the
        optimizers' parameters or the fragments do not match what was saved."""
        load_slots(self.slots, saved, self.transport, self.error_feedback, self.clock)
