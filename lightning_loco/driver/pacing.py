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

``sync_seconds="auto"`` chooses T itself: T = H × the fastest replica's step time, each replica's step time
being the median of its latest inner phases' mean steps (:class:`AutoSeconds`, re-estimated at every round,
so that T follows speeds that drift). The first round, before any estimate, is H steps everywhere. Replicas
learn each other's step times from a :class:`StepTimes` board: the run's store under the static launch
(:class:`StoreStepTimes`: one key a replica, written and read when a round starts, waiting for no replica),
a dictionary in one process (the simulator, tests). Nobody waits for a publication: a replica reads what the
store holds, so it sees the step time of every replica that published before one of its past exchanges
(with its partners, and with theirs before) and may miss a later one until its next round.

:class:`Phase` is the bookkeeping both modes share (the reports' H_i and compute share come from it);
:class:`Pacing` is the policy of ``sync_seconds``. The driver (:mod:`lightning_loco.driver.driver`) asks
:meth:`Pacing.due` once per inner step. No Lightning here.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

AUTO = "auto"
RECENT_PHASES = 5  # the phases a replica's step time is the median over


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
    # sync_seconds="auto": the mean step of the latest phases, and the T they gave (inf: none yet, H steps)
    recent: list[float] = field(default_factory=list)
    target: float = math.inf

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
        out: dict[str, Any] = {"start_step": self.start_step, "seconds": self.seconds(now)}
        if self.recent:
            out["recent"], out["target"] = list(self.recent), self.target
        return out

    def load_state_dict(self, saved: Optional[dict[str, Any]], inner_steps: int, now: float) -> None:
        """Continues a saved phase (its compute so far counts); without one, a phase starts now."""
        self.start_step = inner_steps if saved is None else int(saved["start_step"])
        self.clock_start, self.excluded = now - (0.0 if saved is None else float(saved["seconds"])), 0.0
        self.decision, self.agreed = None, 0.0 if saved is None else float(saved["seconds"])
        self.recent = [] if saved is None else [float(x) for x in saved.get("recent", [])]
        self.target = math.inf if saved is None else float(saved.get("target", math.inf))


class StepTimes(Protocol):
    """Where replicas tell each other their step time (for ``sync_seconds="auto"``)."""

    def publish(self, replica: int, step_seconds: float) -> None: ...

    def fastest(self) -> Optional[float]:
        """The smallest step time heard of so far (None: none yet)."""
        ...


class SharedStepTimes:
    """The board of replicas in one process (the simulator, tests): a dictionary."""

    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def publish(self, replica: int, step_seconds: float) -> None:
        self.values[replica] = step_seconds

    def fastest(self) -> Optional[float]:
        return min(self.values.values()) if self.values else None


class StoreStepTimes:
    """The board of a static launch: key ``<replica>`` of ``store`` (a ``torch.distributed`` store, under a
    prefix of its own) holds that replica's step time. A publication writes this replica's key and reads the
    keys that exist (it waits for no replica): one round trip to the store's host for the write, one to see
    which replicas have published (until all have) and one to read them, once per round."""

    def __init__(self, store: Any, num_replicas: int) -> None:
        self.store, self.num_replicas = store, num_replicas
        self._latest: Optional[float] = None
        self._seen: set[int] = set()

    def publish(self, replica: int, step_seconds: float) -> None:
        self.store.set(str(replica), repr(step_seconds))
        self._seen.add(replica)
        unseen = [r for r in range(self.num_replicas) if r not in self._seen]
        self._seen.update(r for r in unseen if self.store.check([str(r)]))
        keys = [str(r) for r in sorted(self._seen)]
        self._latest = min(float(v.decode() if isinstance(v, bytes) else v) for v in self.store.multi_get(keys))

    def fastest(self) -> Optional[float]:
        return self._latest


class AutoSeconds:
    """``sync_seconds="auto"``: T = H × the fastest step time on the board, each replica publishing the median
    of its latest :data:`RECENT_PHASES` phases' mean steps when a phase ends."""

    def __init__(self, sync_every: int, replica: int, board: StepTimes) -> None:
        self.sync_every, self.replica, self.board = sync_every, replica, board

    def phase_ended(self, phase: Phase) -> None:
        if phase.ended is None or phase.ended[0] <= 0:
            return
        steps, seconds = phase.ended
        phase.recent = (phase.recent + [seconds / steps])[-RECENT_PHASES:]
        self.board.publish(self.replica, statistics.median(phase.recent))
        fastest = self.board.fastest()
        if fastest is not None and fastest > 0:
            phase.target = self.sync_every * fastest


class Pacing:
    """The ``sync_seconds`` policy: a round is due once the inner phase is as close to
    ``sync_seconds`` of compute as its steps allow, or took ``sync_every`` inner steps, whichever
    comes first (at least one step): :func:`phase_due`.

    Args:
        sync_every: H, the most inner steps of a round, and the nominal H that ``max_steps`` is
            counted in.
        sync_seconds: T, the compute time of an inner phase.
        clock: seconds on this replica's own clock (injectable, so that tests are deterministic).
        agree_seconds: with replicas of several ranks, given this rank's phase seconds, returns the
            largest over the replica's ranks. Every rank then decides on the same
            seconds (a round is due when it is due on the slowest clock, which is when any rank is due:
            :func:`phase_due` grows with the seconds) and :meth:`nominal_step` follows them too, so
            that the ranks' learning rates, and hence their weights, stay the same.
    """

    def __init__(self, sync_every: int, sync_seconds: Union[float, str], clock: Callable[[], float],
                 agree_seconds: Optional[Callable[[float], float]] = None,
                 auto: Optional[AutoSeconds] = None) -> None:
        if sync_seconds == AUTO and auto is None:
            raise ValueError("sync_seconds='auto' needs the replicas' step times (an AutoSeconds)")
        self.sync_every, self.auto = sync_every, auto if sync_seconds == AUTO else None
        self.sync_seconds = math.inf if sync_seconds == AUTO else float(sync_seconds)
        self.clock, self.agree_seconds = clock, agree_seconds
        self.max_steps: Optional[int] = None  # the run's nominal length, when it ends on a round
        self.rounds: Optional[int] = None  # R = ⌈max_steps / H⌉

    def target(self, phase: Phase) -> float:
        """T for this phase: ``sync_seconds``, or with "auto" the latest estimate (inf before the first)."""
        return phase.target if self.auto is not None else self.sync_seconds

    def phase_ended(self, phase: Phase) -> None:
        """A phase ended (its round starts): with "auto", its steps feed the next estimate of T."""
        if self.auto is not None:
            self.auto.phase_ended(phase)

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
        due = phase_due(phase.steps(steps), seconds, self.sync_every, self.target(phase))
        if self.max_steps is not None:
            assert self.rounds is not None
            due = outer_steps < self.rounds and (due or steps >= self.max_steps)
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
        share = max(phase.steps(inner_steps) / self.sync_every, seconds / self.target(phase))
        return self.sync_every * (outer_steps + min(1.0, share))
