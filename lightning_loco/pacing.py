"""When a round is due: every H inner steps, or once this replica's inner phase is about T seconds.

By default a round starts every H = ``sync_every`` inner steps of an optimizer, on every replica
alike. Replicas of different speeds then wait for each other: a slow replica delays its partner of
the round, who delays its next partner, and soon every replica runs at the slowest one's pace.

With ``sync_seconds=T`` each replica chooses its own number of inner steps per round, H_i (GASLoC
writes its update with H_i): it posts its next round once its **inner phase** (its compute since its
previous round, on its own clock, the waits at exchanges left out) is as close to T seconds as its
steps allow: after the step k at which one step more would end further past T than it is short of
T now, (k + ½)·s̄ ≥ T with s̄ its mean step in the phase; at least one inner step, at most H. A
replica twice as slow takes about half the inner steps and posts at about the same time, so nobody
waits long; a replica slower than T per step still takes one step per round, and is waited for no
longer than that step.

Only the steps inside a round differ between replicas: round t is round t everywhere, so the groups
of every round agree (they come from ``schedule(t, N)``) and no message is added. A run paced this
way ends on a round: told ``max_steps`` (:meth:`Pacing.end_at`), every replica runs
R = ⌈max_steps / H⌉ rounds and stops when round R − 1 lands, whatever its own step count. A replica
never takes more than max_steps inner steps (at most H per round), so Lightning's own step limit is
never the first to stop it.

:class:`Phase` is the bookkeeping both modes share (the reports' H_i and compute share come from it);
:class:`Pacing` is the policy of ``sync_seconds``. The driver (:mod:`lightning_loco.driver`) asks
:meth:`Pacing.due` once per inner step. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


def phase_due(steps: int, seconds: float, sync_every: int, sync_seconds: float) -> bool:
    """Whether an inner phase of ``steps`` steps and ``seconds`` of compute ends now: H steps, or the
    phase as close to T as one step more or less could bring it, (k + ½)·seconds/k ≥ T."""
    return steps >= 1 and (steps >= sync_every or seconds * (1 + 0.5 / steps) >= sync_seconds)


def phase_steps(step_seconds: float, sync_every: int, sync_seconds: float) -> int:
    """H_i of a replica whose every step takes ``step_seconds`` (the event model of the schedules)."""
    k = 1
    while not phase_due(k, k * step_seconds, sync_every, sync_seconds):
        k += 1
    return k


def compute_share(compute: Optional[float], spent: float) -> Optional[float]:
    """An inner phase's compute over its wall time (the compute and the round's ``spent`` seconds)."""
    if compute is None:
        return None
    return compute / (compute + spent) if compute + spent > 0 else 1.0


@dataclass
class Phase:
    """The inner phase of one optimizer on this replica: its inner steps and compute since its
    previous round started, with the time spent in rounds since then left out."""

    start_step: int = 0  # the optimizer's step count when the previous round started
    clock_start: float = 0.0  # the clock when the previous round's work ended
    excluded: float = 0.0  # seconds spent in rounds since then (an overlapped landing)
    ended: Optional[tuple[int, float]] = None  # (inner steps, compute seconds) of the phase the latest round ended
    spent: float = 0.0  # seconds the latest round's start took (its landing's are added in the report)
    decision: Optional[tuple[int, bool]] = None  # (step count, due): a round is decided once per inner step
    agreed: float = 0.0  # the phase's seconds at its latest decision, as the replica's ranks agreed on them

    def steps(self, inner_steps: int) -> int:
        return inner_steps - self.start_step

    def seconds(self, now: float) -> float:
        return now - self.clock_start - self.excluded

    def end(self, inner_steps: int, now: float) -> int:
        """A round starts: the phase that led to it is over. Returns its inner steps."""
        self.ended = (self.steps(inner_steps), self.seconds(now))
        self.start_step = inner_steps
        return self.ended[0]

    def restart(self, now: float) -> None:
        """The round's work is done: the next phase's compute counts from ``now``."""
        self.clock_start, self.excluded, self.agreed = now, 0.0, 0.0

    def state_dict(self, now: float) -> dict[str, Any]:
        return {"start_step": self.start_step, "seconds": self.seconds(now)}

    def load_state_dict(self, saved: Optional[dict[str, Any]], inner_steps: int, now: float) -> None:
        """Continues a saved phase (its compute so far counts); without one, a phase starts now."""
        self.start_step = inner_steps if saved is None else int(saved["start_step"])
        self.clock_start, self.excluded = now - (0.0 if saved is None else float(saved["seconds"])), 0.0
        self.decision, self.agreed = None, 0.0 if saved is None else float(saved["seconds"])


class Pacing:
    """The ``sync_seconds`` policy: a round is due once the inner phase is as close to
    ``sync_seconds`` of compute as its steps allow, or took ``sync_every`` inner steps, whichever
    comes first (at least one step): :func:`phase_due`.

    Args:
        sync_every: H, the most inner steps of a round, and the nominal H that ``max_steps`` is
            counted in.
        sync_seconds: T, the compute time of an inner phase.
        clock: seconds on this replica's own clock (injectable, so that tests are deterministic).
        agree: with replicas of several ranks, makes the ranks of a replica agree (given 0 or 1, returns
            the largest over the replica's ranks): a rank whose clock says "due" makes all of them post.
        agree_seconds: with replicas of several ranks, in place of ``agree``: given this rank's phase
            seconds, returns the largest over the replica's ranks. Every rank then decides on the same
            seconds (a round is due when it is due on the slowest clock, which is when any rank is due:
            :func:`phase_due` grows with the seconds) and :meth:`nominal_step` follows them too, so
            that the ranks' learning rates, and hence their weights, stay the same.
    """

    def __init__(self, sync_every: int, sync_seconds: float, clock: Callable[[], float],
                 agree: Optional[Callable[[int], int]] = None,
                 agree_seconds: Optional[Callable[[float], float]] = None) -> None:
        self.sync_every, self.sync_seconds = sync_every, float(sync_seconds)
        self.clock, self.agree, self.agree_seconds = clock, agree, agree_seconds
        self.max_steps: Optional[int] = None  # the run's nominal length, when it ends on a round
        self.rounds: Optional[int] = None  # R = ⌈max_steps / H⌉

    def end_at(self, max_steps: int) -> None:
        """The run ends when round ⌈max_steps / H⌉ − 1 lands, on every replica."""
        self.max_steps, self.rounds = max_steps, -(-max_steps // self.sync_every)

    def due(self, phase: Phase, outer_steps: int, steps: int) -> bool:
        """Whether the inner step that brings the optimizer's count to ``steps`` starts a round. Taken
        once per step, on the clock at the first call (the step's compute is done by then)."""
        if phase.decision is not None and phase.decision[0] == steps:
            return phase.decision[1]
        seconds = phase.seconds(self.clock())
        if self.agree_seconds is not None:
            seconds = phase.agreed = self.agree_seconds(seconds)
        due = phase_due(phase.steps(steps), seconds, self.sync_every, self.sync_seconds)
        if self.max_steps is not None:
            assert self.rounds is not None
            due = outer_steps < self.rounds and (due or steps >= self.max_steps)
        if self.agree is not None and self.agree_seconds is None:
            due = bool(self.agree(int(due)))
        phase.decision = (steps, due)
        return due

    def last(self, phase: Phase, outer_steps: int, steps: int) -> bool:
        """Whether training ends after the inner step that brings the count to ``steps``: it starts the
        run's last round, or every round has been run already (a run resumed after its end)."""
        assert self.rounds is not None, "end_at(max_steps) first"
        if outer_steps >= self.rounds:
            return True
        return self.due(phase, outer_steps, steps) and outer_steps == self.rounds - 1

    def nominal_step(self, phase: Phase, outer_steps: int, inner_steps: int) -> float:
        """The run's progress in nominal inner steps: t·H plus the share of the current phase done
        (its steps out of H or its compute out of T, whichever is further). What a learning-rate
        schedule should follow, where a replica's own step count runs slow or fast. With
        ``agree_seconds``, the phase's seconds are those its ranks agreed on at the latest step (each
        rank's own clock would give each a learning rate of its own)."""
        seconds = phase.agreed if self.agree_seconds is not None else phase.seconds(self.clock())
        share = max(phase.steps(inner_steps) / self.sync_every, seconds / self.sync_seconds)
        return self.sync_every * (outer_steps + min(1.0, share))
