"""Replicas of different speeds: each replica's H_i under ``sync_seconds``, on the in-process transport.

No processes and no Lightning. Every replica has its own clock, which advances by the replica's step
time at each inner step (and not while it waits at an exchange), so each replica's H_i is decided
exactly as it would be on a real clock, deterministically. Replicas run in threads of their own: a
synchronous round blocks until its group has posted. The maths is checked against
:class:`ReplicaSimulator` fed with the snapshots the driver posted: unequal H_i change what is sent,
never how it is combined (the default plain mean, docs/heterogeneous.md; ``merge="steps"`` is
tests/test_step_weighted.py's).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import Tensor

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.driver.pacing import Pacing, Phase, phase_due, phase_steps
from lightning_loco.replica.options import PacingConfig
from lightning_loco.rules import build_options
from lightning_loco.transport import InProcessNetwork

from oracle import ReplicaSimulator
from test_driver import CPU, SLOT_SHAPES, assert_same, initial_weights, inner_lr, roundtrip, run_in_threads, targets

MAKERS = {
    "noloco": NoLoCo,
    "gasloc": lambda: GASLoC(topology="random_pairs"),
    "gasloc_ring": lambda: GASLoC(topology="ring"),
    "diloco": DiLoCo,
}


class Clock:
    """A replica's own clock: it moves when the replica computes, by its step time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PacedReplica:
    """One replica training the tiny model of ``test_driver`` (θ ← θ − lr·(θ − target_i)) with its own
    speed; it tells its driver of every step, and the end of the run when told ``max_steps``."""

    def __init__(self, i: int, network: InProcessNetwork, algorithm, speed: float, sync_every: int,
                 sync_seconds: float | None, max_steps: int | None = None, weights: Tensor | None = None,
                 **driver_kwargs) -> None:
        self.i, self.speed, self.max_steps = i, speed, max_steps
        self.clock = Clock()
        merge = driver_kwargs.pop("merge", "mean")
        # follow_nominal: the learning rate's step count follows the run's nominal progress, as a scheduler
        # does on a paced strategy or simulator (lightning_loco.driver.lr_schedules), not this replica's own count
        self.follow_nominal = driver_kwargs.pop("follow_nominal", False)
        self.schedule_steps = 0
        pacing = None if sync_seconds is None else PacingConfig(sync_seconds, merge=merge)
        self.driver = OuterStepDriver.of(algorithm, network.transport(i), sync_every, pacing=pacing,
                                         clock=self.clock, **driver_kwargs)
        self.flat = FlatParameters([torch.nn.Parameter(w) for w in initial_weights(SLOT_SHAPES[0], seed=0)], CPU)
        if weights is not None:
            self.flat.scatter(weights)
        self.initial = self.flat.gather()
        self.target = torch.cat([t.reshape(-1) for t in targets(i, 0, SLOT_SHAPES[0])])
        self.driver.add(self.flat)
        self.snapshots: list[Tensor] = []  # the weights each round was posted from
        self.anchors: list[Tensor] = []  # the anchor after each landing
        self.trace: list[Tensor] = []  # live weights after every step

    def step(self) -> bool:
        """One inner step; returns whether training ends after it."""
        self.clock.now += self.speed
        slot = self.driver.slots[0]
        with torch.no_grad():
            for p, target in zip(self.flat.params, self.target.split([p.numel() for p in self.flat.params])):
                done = self.schedule_steps if self.follow_nominal else slot.inner_steps
                p.sub_((p - target.view_as(p)).mul_(inner_lr(done + 1)))
        last = self.max_steps is not None and self.driver.last_step(0, self.max_steps)
        if self.driver.round_due(0):
            self.snapshots.append(self.flat.gather())
        landed = len(self.driver.reports)
        self.driver.after_inner_step(0, last=last)
        if len(self.driver.reports) > landed:
            self.anchors.append(slot.state.anchor.clone())
        if self.follow_nominal:
            self.schedule_steps += 1
            nominal = math.floor(self.driver.nominal_step() + 1e-9)
            self.schedule_steps = max(self.schedule_steps, min(nominal, self.max_steps or nominal))
        self.trace.append(self.flat.gather())
        return last

    def run(self, steps: int | None = None) -> None:
        for _ in range(steps if steps is not None else 10**6):
            if self.step():
                return
        assert steps is not None, "the run never ended"


def paced(make, speeds, sync_every, sync_seconds, max_steps=None, network=None, weights=None, **kwargs):
    network = network or InProcessNetwork(len(speeds), timeout=10.0)
    return network, [PacedReplica(i, network, make(), s, sync_every, sync_seconds, max_steps,
                                  None if weights is None else weights[i], **kwargs)
                     for i, s in enumerate(speeds)]


def threaded(replicas, steps=None):
    run_in_threads([functools.partial(r.run, steps) for r in replicas])


def expected_h(speed: float, sync_every: int, sync_seconds: float) -> int:
    """The steps a replica of this speed takes per round: the k whose k·speed is nearest T (a tie goes
    to the shorter phase), at least 1, at most H."""
    return max(1, min(sync_every, math.ceil(sync_seconds / speed - 0.5 - 1e-9)))


# ---------------------------------------------------------------------------- H_i follows each replica's speed


@pytest.mark.parametrize("name", list(MAKERS))
def test_each_replica_takes_its_own_steps_per_round_and_every_round_agrees(name):
    speeds, H, T, max_steps = (1, 1, 2, 4), 8, 6, 24  # H_i = 6, 6, 3, 1; the run is ⌈24 / 8⌉ = 3 rounds
    make = MAKERS[name]
    _, replicas = paced(make, speeds, H, T, max_steps)
    threaded(replicas)
    rounds = 3
    algorithm, n = make(), len(speeds)
    for r in replicas:
        h = {1: 6, 2: 3, 4: 1}[r.speed]  # the 4× replica: one step (4 s) is as near T = 6 as two (8 s)
        assert h == expected_h(r.speed, H, T)
        reports = r.driver.reports
        assert [x.outer_step for x in reports] == list(range(rounds))  # the same rounds, in order, everywhere
        assert [x.phase_steps for x in reports] == [h] * rounds
        assert [x.inner_step for x in reports] == [h * (t + 1) for t in range(rounds)]
        assert [x.compute_seconds for x in reports] == [h * r.speed] * rounds  # on its own clock, waits excluded
        assert r.driver.slots[0].inner_steps == rounds * h
        assert [x.final for x in reports] == [False] * (rounds - 1) + [True]  # all end on the same round
        for x in reports:
            assert x.peers == algorithm.schedule(x.outer_step, n).peers_of(r.i)
    for t in range(rounds):  # partners agree: j met i at round t exactly when i met j
        met = {(r.i, j) for r in replicas for j in r.driver.reports[t].peers}
        assert met == {(j, i) for i, j in met}
    # the maths: the algorithm's own step on the snapshots each replica posted, bitwise
    sim = ReplicaSimulator(make(), [replicas[0].initial] * n, replicas[0].flat.shapes)
    for t in range(rounds):
        sim.step([r.snapshots[t] for r in replicas])
        for r in replicas:
            assert_same(r.anchors[t], sim.anchors[r.i], f"anchor of replica {r.i} after round {t}")


@pytest.mark.parametrize("speed,steps", [(1.0, 6), (1.1, 5), (1.4, 4), (2.5, 2), (4.0, 1), (7.0, 1)])
def test_a_phase_ends_as_near_t_as_its_steps_allow(speed, steps):
    # T = 6: 1.1 s steps end at 5.5 s (not 6.6), 1.4 s steps at 5.6 s (not 7.0), 2.5 s steps at 5 s (not 7.5)
    assert phase_steps(speed, 8, 6.0) == steps
    assert not phase_due(0, 0.0, 8, 6.0) and phase_due(8, 0.0, 8, 6.0)  # at least one step, at most H


def test_a_ten_times_slower_replica_takes_one_step_per_round_and_is_never_left_out():
    speeds, H, T = (1, 1, 1, 10), 8, 4
    _, replicas = paced(NoLoCo, speeds, H, T, max_steps=5 * H)
    threaded(replicas)
    for r in replicas:
        assert [x.phase_steps for x in r.driver.reports] == [1 if r.speed == 10 else 4] * 5
    assert {len(r.driver.reports[t].peers) for r in replicas for t in range(5)} == {1}


def test_the_step_cap_and_max_steps_bound_every_round():
    # H = 8 caps the fast replicas before T = 12; max_steps = 20 is not a multiple of H, so the run has
    # ⌈20 / 8⌉ = 3 rounds and the fast replicas' last round starts at their step 20 (four steps).
    speeds, H, T = (1, 2, 4, 1), 8, 12
    _, replicas = paced(GASLoC, speeds, H, T, max_steps=20)
    threaded(replicas)
    steps = {1: [8, 8, 4], 2: [6, 6, 6], 4: [3, 3, 3]}
    for r in replicas:
        assert [x.phase_steps for x in r.driver.reports] == steps[r.speed]
        assert r.driver.slots[0].inner_steps <= 20
        assert r.driver.reports[-1].final and r.driver.slots[0].outer_steps == 3


def test_equal_speeds_paced_at_h_steps_are_bitwise_the_fixed_h_run():
    """The fixed path is unchanged, and pacing that happens to give every replica H steps is exactly it."""
    speeds, H = (1.0, 1.0, 1.0, 1.0), 4
    _, fixed = paced(NoLoCo, speeds, H, None)
    _, timed = paced(NoLoCo, speeds, H, sync_seconds=H * 1.0)
    threaded(fixed, 3 * H)
    threaded(timed, 3 * H)
    for a, b in zip(fixed, timed):
        assert len(a.trace) == len(b.trace) == 3 * H
        for step, (x, y) in enumerate(zip(a.trace, b.trace)):
            assert_same(x, y, f"replica {a.i} after step {step + 1}")
        assert [x.phase_steps for x in a.driver.reports] == [x.phase_steps for x in b.driver.reports] == [H] * 3


def test_fixed_h_reports_its_phase_too():
    _, replicas = paced(DiLoCo, (1, 3), 3, None)
    threaded(replicas, 6)
    for r in replicas:
        assert [(x.phase_steps, x.compute_seconds) for x in r.driver.reports] == [(3, 3.0 * r.speed)] * 2
        assert all(x.compute_share == 1.0 for x in r.driver.reports)  # no time passes at an exchange here


# ---------------------------------------------------------------------------- resume, ranks, progress


@pytest.mark.parametrize("merge", ["mean", "steps"])
@pytest.mark.parametrize("name", ["noloco", "diloco"])
def test_resuming_mid_phase_continues_bitwise(name, merge):
    """Also with the merge weighted by steps (``merge="steps"``), which keeps no state of its own."""
    speeds, H, T, max_steps = (1, 2, 3), 6, 6, 24  # H_i = 6, 3, 2; 4 rounds
    make = MAKERS[name]
    _, whole = paced(make, speeds, H, T, max_steps, merge=merge)
    threaded(whole)
    cuts = [2 * expected_h(s, H, T) + 1 for s in speeds]  # one step into round 2's phase on every replica
    _, first = paced(make, speeds, H, T, max_steps, merge=merge)
    run_in_threads([functools.partial(r.run, c) for r, c in zip(first, cuts)])
    saved = [roundtrip(r.driver.state_dict()) for r in first]
    assert [s[0]["phase"] for s in saved] == [{"start_step": c - 1, "seconds": s} for c, s in zip(cuts, speeds)]
    _, resumed = paced(make, speeds, H, T, max_steps, weights=[r.flat.gather() for r in first], merge=merge)
    for r, s in zip(resumed, saved):
        r.clock.now = 1000.0  # another process, another clock
        r.driver.load_state_dict(s)
    threaded(resumed)
    for r, w, c in zip(resumed, whole, cuts):
        assert len(r.trace) == len(w.trace) - c
        for step, (x, y) in enumerate(zip(r.trace, w.trace[c:])):
            assert_same(x, y, f"replica {r.i} after step {c + step + 1}")
        assert [x.phase_steps for x in r.driver.reports] == [x.phase_steps for x in w.driver.reports][2:]


def test_the_ranks_of_a_replica_post_when_any_of_them_is_due():
    asked: dict[int, list[float]] = {0: [], 1: []}

    def agree_for(i: int):
        def agree_seconds(seconds: float) -> float:
            asked[i].append(seconds)
            # another rank of replica i is due at its second step: its clock says the whole phase is spent
            return 100.0 if len(asked[i]) == 2 else seconds
        return agree_seconds

    network = InProcessNetwork(2, timeout=10.0)
    replicas = [PacedReplica(i, network, NoLoCo(), 1, 8, 100.0, agree_seconds=agree_for(i)) for i in range(2)]
    threaded(replicas, 2)
    for r in replicas:
        assert asked[r.i] == [1.0, 2.0]  # asked once per step, with this rank's own seconds (not due by itself)
        assert [x.phase_steps for x in r.driver.reports] == [2]


def test_the_ranks_of_a_replica_agree_on_their_phase_seconds_for_rounds_and_nominal_progress():
    clock, asked = Clock(), []

    def agree_seconds(seconds: float) -> float:
        asked.append(seconds)
        return seconds + 1.0  # another rank of the replica: its clock says one second more

    pacing = Pacing(sync_every=10, sync_seconds=5.0, clock=clock, agree_seconds=agree_seconds)
    phase = Phase()
    clock.now = 1.0
    assert not pacing.due(phase, outer_steps=0, steps=2)  # agreed 2 s: (2 + ½)·1 s < 5 s
    assert pacing.nominal_step(phase, 0, 2) == 10 * 2.0 / 5.0  # the agreed seconds, not this clock's 1 s
    clock.now = 1.5
    assert pacing.nominal_step(phase, 0, 2) == 4.0  # between decisions: the latest agreed seconds
    clock.now = 3.5
    assert pacing.due(phase, outer_steps=0, steps=4)  # agreed 4.5 s: (4 + ½)·1.125 s ≥ 5 s; alone it is not
    assert asked == [1.0, 3.5]  # once per step, with this rank's own seconds
    phase.end(4, 3.5)
    phase.restart(3.5)
    assert pacing.nominal_step(phase, outer_steps=1, inner_steps=4) == 10.0  # a new phase: nothing agreed yet


def test_nominal_progress_follows_the_phase_not_the_step_count():
    clock = Clock()
    pacing = Pacing(sync_every=10, sync_seconds=5.0, clock=clock)
    phase = Phase()
    clock.now = 2.0  # a slow replica: one step, 2 of 5 seconds
    assert pacing.nominal_step(phase, outer_steps=3, inner_steps=1) == pytest.approx(10 * (3 + 0.4))
    clock.now = 1.0  # a fast replica: 6 of 10 steps in 1 s
    assert pacing.nominal_step(phase, outer_steps=3, inner_steps=6) == pytest.approx(36.0)
    clock.now = 50.0
    assert pacing.nominal_step(phase, outer_steps=3, inner_steps=1) == 40.0  # never past the round's end
    fixed = OuterStepDriver.of(NoLoCo(), InProcessNetwork(1).transport(0), 4)
    fixed.add(FlatParameters([torch.nn.Parameter(torch.zeros(2))], CPU))
    fixed.after_inner_step(0)
    assert fixed.nominal_step() == 1.0  # fixed H: the step count itself


def test_a_run_resumed_after_its_last_round_stops_at_once():
    clock = Clock()
    pacing = Pacing(4, 2.0, clock)
    pacing.end_at(8)
    phase = Phase()
    assert pacing.last(phase, outer_steps=2, steps=9) and not pacing.due(phase, outer_steps=2, steps=9)


# ---------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "10", True])
def test_bad_sync_seconds_fail_when_the_driver_is_built(value):
    with pytest.raises(ValueError, match="sync_seconds must be a number of seconds > 0"):
        OuterStepDriver.of(NoLoCo(), InProcessNetwork(2).transport(0), 4, pacing=value)


@pytest.mark.parametrize("overlap", [1, "auto"])
def test_sync_seconds_with_overlap_fails_when_the_driver_s_options_are_built(overlap):
    with pytest.raises(ValueError, match="cannot be combined yet.*Use overlap_steps=0 with pacing"):
        OuterStepDriver(build_options(NoLoCo(), 4, overlap_steps=overlap, pacing=1.0), InProcessNetwork(2).transport(0))


# ---------------------------------------------------------------------------- sync_seconds="auto"


def test_auto_sets_t_to_h_times_the_fastest_replicas_median_step_and_follows_a_drift():
    from lightning_loco.driver.pacing import RECENT_PHASES, AutoSeconds, SharedStepTimes

    board = SharedStepTimes()
    me, other = AutoSeconds(10, 0, board), AutoSeconds(10, 1, board)
    mine, theirs = Phase(), Phase()
    assert Pacing(10, "auto", lambda: 0.0, auto=me).target(mine) == math.inf  # no estimate: H steps
    board.publish(1, 0.5)
    for k in range(RECENT_PHASES):  # this replica steps in 2 s, then a stall of 20 s (one phase) is outvoted
        mine.ended = (4, 8.0 if k != 2 else 80.0)
        me.phase_ended(mine)
    assert mine.recent == [2.0, 2.0, 20.0, 2.0, 2.0] and mine.target == 10 * 0.5  # the other one is faster
    assert board.values[0] == 2.0  # the median, not the mean
    theirs.ended = (10, 40.0)  # the fast one slowed down to 4 s a step: the estimate follows
    for _ in range(RECENT_PHASES // 2 + 1):
        other.phase_ended(theirs)
    assert board.values[1] == 4.0
    mine.ended = (4, 8.0)
    me.phase_ended(mine)
    assert mine.target == 10 * 2.0  # now this replica is the fastest
    # the estimate is part of the phase's saved state: a resumed run goes on with it
    again = Phase()
    again.load_state_dict(mine.state_dict(0.0), 0, 0.0)
    assert again.recent == mine.recent and again.target == mine.target


def test_auto_paced_replicas_take_h_steps_first_then_their_own_share():
    from lightning_loco.driver.pacing import SharedStepTimes

    H, max_steps, board = 8, 48, SharedStepTimes()  # six rounds; speeds 1 s and 2 s a step
    _, replicas = paced(NoLoCo, (1, 2), H, "auto", max_steps, step_times=board)
    threaded(replicas)
    fast, slow = ([r.phase_steps for r in rep.driver.reports] for rep in replicas)
    # round 0 runs before any estimate; a round's T is set when the round before starts, and from round 2 on
    # the other's step time was published before an exchange this replica took part in: T = 8 × 1 s
    assert fast[0] == slow[0] == H and fast[1] == H
    assert fast[2:] == [H] * 4 and slow[2:] == [expected_h(2, H, 8.0)] * 4 == [4] * 4
    assert all(r.driver.reports[-1].final for r in replicas)
