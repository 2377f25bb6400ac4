"""The outer-step driver over the in-process transport: schedules, overlap, failures, checkpoints.

No processes and no Lightning. Each replica trains a tiny deterministic model (θ ← θ − lr·(θ − target_i),
a different target per replica) and tells its :class:`OuterStepDriver` of every inner step. A
synchronous round blocks until its group's peers post, so those replicas run in threads of their own;
an overlapped round never blocks before its landing, so those run in lock-step in one thread (every
replica takes step s before any takes step s + 1). The reference is :class:`ReplicaSimulator` fed
with the snapshots the driver started its rounds from (docs: "anchors are the synchronous formula
applied to snapshots").
"""

from __future__ import annotations

import functools
import io
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.driver import OuterStepDriver, OuterStepReport
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.driver.overlap import MERGES, auto_cap
from lightning_loco.driver.rounds import step as blocking_outer_step
from lightning_loco.replica.options import Options
from lightning_loco.transport import InProcessNetwork, PeerError

from oracle import ReplicaSimulator

CPU = torch.device("cpu")
SLOT_SHAPES = (((3,), (2, 2)), ((5,),))  # optimizer 0 has two parameters, optimizer 1 one
JOIN_S = 30.0  # a guard against a deadlock, not a measurement

ALGORITHMS: dict[str, Callable[[], Any]] = {
    "noloco": lambda: NoLoCo(),
    "noloco_gamma0.9": lambda: NoLoCo(averaging_rate=0.9),
    "noloco_n3": lambda: NoLoCo(group_size=3, seed=1),
    "diloco": lambda: DiLoCo(),
    "gasloc_random_pairs": lambda: GASLoC(topology="random_pairs"),
    "gasloc_ring": lambda: GASLoC(topology="ring"),
    "gasloc_exponential": lambda: GASLoC(topology="exponential"),
    "gasloc_complete": lambda: GASLoC(topology="complete"),
    "gasloc_adam": lambda: GASLoC(outer_optimizer=functools.partial(torch.optim.Adam, lr=0.01)),
}


# ---------------------------------------------------------------------------- a tiny training


def inner_lr(step: int) -> float:
    return 0.1 + 0.02 * (step % 3)  # varies with the step, so that no two inner steps are alike


def initial_weights(shapes, seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in shapes]  # the same on every replica


def targets(replica: int, slot: int, shapes) -> list[Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * replica + slot)
    return [2 * torch.randn(shape, generator=g) for shape in shapes]  # different on every replica


@dataclass
class Landing:
    report: OuterStepReport
    before: Tensor  # live weights before the after_inner_step call that landed the round
    after: Tensor  # live weights after it
    anchor: Tensor  # the anchor after it


@dataclass
class Log:
    starts: list[Tensor] = field(default_factory=list)  # the snapshot S of each round
    after_start: list[Tensor] = field(default_factory=list)  # live weights just after each start
    landings: list[Landing] = field(default_factory=list)


class Replica:
    """One replica: its parameters (one FlatParameters per optimizer), targets, driver and logs."""

    def __init__(self, i: int, network: InProcessNetwork, algorithm, sync_every: int, slots: int = 1,
                 weights: list[Tensor] | None = None, transport=None, **driver_kwargs) -> None:
        self.i = i
        transport = network.transport(i) if transport is None else transport
        self.driver = OuterStepDriver.of(algorithm, transport, sync_every, **driver_kwargs)
        self.flats: list[FlatParameters] = []
        self.targets: list[list[Tensor]] = []
        self.initial: list[Tensor] = []
        self.logs: list[Log] = []
        for k in range(slots):
            shapes = SLOT_SHAPES[k]
            flat = FlatParameters([torch.nn.Parameter(w) for w in initial_weights(shapes, seed=k)], CPU)
            if weights is not None:
                flat.scatter(weights[k])
            self.initial.append(flat.gather())
            self.flats.append(flat)
            self.targets.append(targets(i, k, shapes))
            self.logs.append(Log())
            self.driver.add(flat)

    def step(self, index: int = 0) -> None:
        """One inner step of optimizer ``index``, then the driver's hook; logs starts and landings."""
        flat, slot, log = self.flats[index], self.driver.slots[index], self.logs[index]
        starts = self.driver.round_due(index)
        lr = inner_lr(slot.inner_steps + 1)
        with torch.no_grad():
            for p, target in zip(flat.params, self.targets[index]):
                p.sub_((p - target).mul_(lr))
        before = flat.gather()
        seen = len(self.driver.reports)
        self.driver.after_inner_step(index)
        after = flat.gather()
        if starts:
            log.starts.append(before)
            log.after_start.append(after)
        for report in self.driver.reports[seen:]:
            assert report.optimizer_index == index
            log.landings.append(Landing(report, before, after, slot.state.anchor.clone()))

    def run(self, steps: int, index: int = 0) -> None:
        for _ in range(steps):
            self.step(index)


def replicas_for(make_algorithm, n: int, sync_every: int, network: InProcessNetwork | None = None,
                 weights: list[list[Tensor]] | None = None, **kwargs) -> tuple[InProcessNetwork, list[Replica]]:
    """N replicas on one network; ``weights[i]``: replica i's flat weights per optimizer (default: the
    same initial weights everywhere). A wait that should not happen fails after 10 s instead of 30."""
    network = network or InProcessNetwork(n, timeout=10.0)
    return network, [
        Replica(i, network, make_algorithm(), sync_every, weights=None if weights is None else weights[i], **kwargs)
        for i in range(n)
    ]


def run_in_threads(functions: list[Callable[[], None]], timeout: float = JOIN_S) -> None:
    """Runs each function in a thread of its own, joins them, and re-raises the first exception."""
    errors: list[BaseException | None] = [None] * len(functions)

    def target(k: int) -> None:
        try:
            functions[k]()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            errors[k] = error

    threads = [threading.Thread(target=target, args=(k,), daemon=True) for k in range(len(functions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    stuck = [k for k, thread in enumerate(threads) if thread.is_alive()]
    assert not stuck, f"thread(s) {stuck} never finished: a deadlock"
    for error in errors:
        if error is not None:
            raise error


def threaded(replicas: list[Replica], steps: int, index: int = 0) -> None:
    run_in_threads([functools.partial(r.run, steps, index) for r in replicas])


def lockstep(replicas: list[Replica], steps: int, index: int = 0) -> None:
    for _ in range(steps):
        for r in replicas:
            r.step(index)


def assert_same(actual: Tensor, expected: Tensor, what: str = "") -> None:
    assert torch.equal(actual, expected), f"{what}: max difference {(actual - expected).abs().max().item()}"


def norm(x: Tensor) -> float:
    return torch.linalg.vector_norm(x).item()


def payload_bytes(make_algorithm, flat: FlatParameters) -> int:
    algorithm, weights = make_algorithm(), flat.gather()
    return algorithm.payload(algorithm.init_state(weights, flat.shapes), weights).numel() * 4


def check_rounds(make_algorithm, replicas: list[Replica], tau: int, merge: str = "predict_correct",
                 index: int = 0) -> int:
    """Round by round against the simulator fed with the logged snapshots: anchors after each landing
    bitwise, reports, and the live weights (τ = 0: the outer step's; τ > 0: the merge's, from φ⁺ and
    φ̂ = ``local_proxy`` of the state at the start). Returns the number of rounds checked."""
    n = len(replicas)
    algorithm = make_algorithm()
    sim = ReplicaSimulator(make_algorithm(), [replicas[0].initial[index]] * n, replicas[0].flats[index].shapes)
    H = replicas[0].driver.sync_every
    rounds = len(replicas[0].logs[index].landings)
    assert rounds >= 2
    for t in range(rounds):
        snapshots = [r.logs[index].starts[t] for r in replicas]
        round_ = algorithm.schedule(t, n)
        proxies = [algorithm.local_proxy(sim.states[i], snapshots[i], len(round_.group_of(i))) for i in range(n)]
        new = sim.step(snapshots)
        for i, r in enumerate(replicas):
            log = r.logs[index]
            landing, report = log.landings[t], log.landings[t].report
            where = f"replica {i}, optimizer {index}, round {t}"
            assert (report.optimizer_index, report.outer_step) == (index, t)
            assert (report.inner_step, report.overlap_steps) == ((t + 1) * H + tau, tau)
            assert report.peers == round_.peers_of(i)
            assert_same(landing.anchor, sim.anchors[i], f"anchor of {where}")
            if tau == 0:
                assert report.correction_norm is None and report.exchange_seconds is None
                assert_same(landing.before, snapshots[i], f"snapshot of {where}")
                assert_same(landing.after, new[i], f"live weights of {where}")
                continue
            if merge == "predict_correct":  # θ ← φ̂ at the start, θ + (φ⁺ − φ̂) at the landing
                assert_same(log.after_start[t], proxies[i], f"prediction of {where}")
                expected = landing.before + (new[i] - proxies[i])
            else:  # nothing at the start, φ⁺ + (θ − S) at the landing
                assert_same(log.after_start[t], snapshots[i], f"start of {where}")
                expected = new[i] + (landing.before - snapshots[i])
            assert_same(landing.after, expected, f"merged weights of {where}")
            assert report.correction_norm == pytest.approx(norm(expected - landing.before), rel=1e-5, abs=1e-6)
    return rounds


# ---------------------------------------------------------------------------- 1. synchronous rounds

SYNC_CASES = [
    ("noloco", 4), ("noloco_gamma0.9", 4), ("noloco", 5), ("noloco_n3", 6), ("noloco_n3", 4),
    ("diloco", 4), ("gasloc_random_pairs", 4), ("gasloc_ring", 4), ("gasloc_ring", 3), ("gasloc_ring", 5),
    ("gasloc_exponential", 4), ("gasloc_complete", 4), ("gasloc_adam", 4),
]


@pytest.mark.parametrize("name,n", SYNC_CASES)
def test_synchronous_rounds_equal_the_simulator(name, n):
    H, rounds = 3, 4
    _, replicas = replicas_for(ALGORITHMS[name], n, H)
    threaded(replicas, rounds * H)
    assert check_rounds(ALGORITHMS[name], replicas, tau=0) == rounds
    algorithm, size = ALGORITHMS[name](), payload_bytes(ALGORITHMS[name], replicas[0].flats[0])
    sat_out = 0
    for r in replicas:
        reports = r.driver.reports
        assert [x.inner_step for x in reports] == [H * (t + 1) for t in range(rounds)]
        for x in reports:
            peers = len(x.peers)
            sat_out += peers == 0
            expected = 2 * (n - 1) * size // n if algorithm.schedule(x.outer_step, n).collective else size * peers
            assert x.bytes_sent == x.bytes_received == expected
        assert r.driver.transport.stats.bytes_sent == sum(x.bytes_sent for x in reports)
        assert r.driver.rounds_started == [(0, t) for t in range(rounds)]
    # with an odd ring one replica sits out every round, and nobody else ever does
    assert sat_out == (rounds if name == "gasloc_ring" and n % 2 else 0)


# ---------------------------------------------------------------------------- 2. overlap does not block


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("name", ["noloco", "diloco", "gasloc_random_pairs"])
def test_an_overlapped_round_never_blocks_before_its_landing(name, merge):
    n, H, tau, rounds = 4, 4, 2, 3
    network = InProcessNetwork(n, timeout=5.0)  # a wait before the release would fail, not hang
    _, replicas = replicas_for(ALGORITHMS[name], n, H, network=network, overlap_steps=tau, overlap_merge=merge)
    network.hold()  # a slow link: nothing completes until released
    lockstep(replicas, H)  # round 0 starts at step H
    assert sorted(replica for replica, _ in network.posts) == list(range(n))
    lockstep(replicas, tau - 1)  # the steps in between
    assert network.waits == []
    for r in replicas:
        flight = r.driver.slots[0].in_flight
        assert (flight.start_step, flight.land_step) == (H, H + tau)
        assert not flight.pending.done()
        assert r.driver.reports == []
    network.release()
    lockstep(replicas, 1)  # the landing step
    groups = dict(network.posts)
    assert sorted(replica for replica, _ in network.waits) == list(range(n))  # once per replica
    assert all(group == groups[replica] for replica, group in network.waits)
    lockstep(replicas, rounds * H - H)  # the next rounds, on a free link
    assert len(network.waits) == len(network.posts) == rounds * n
    for r in replicas:
        assert [(x.outer_step, x.inner_step, x.overlap_steps) for x in r.driver.reports] == [
            (t, (t + 1) * H + tau, tau) for t in range(rounds)
        ]


# ---------------------------------------------------------------------------- 3, 7. anchor identities

OVERLAP_CASES = [("noloco", 4), ("noloco_gamma0.9", 4), ("diloco", 4), ("gasloc_random_pairs", 4),
                 ("gasloc_ring", 5), ("gasloc_complete", 4)]


@pytest.mark.parametrize("tau", [1, 3])
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("name,n", OVERLAP_CASES)
def test_overlapped_anchors_are_the_synchronous_step_on_the_snapshots(name, n, merge, tau):
    H, rounds = 4, 3
    _, replicas = replicas_for(ALGORITHMS[name], n, H, overlap_steps=tau, overlap_merge=merge)
    lockstep(replicas, rounds * H + tau)
    assert check_rounds(ALGORITHMS[name], replicas, tau, merge) == rounds


@pytest.mark.parametrize("tau", [1, 2])
@pytest.mark.parametrize("merge", MERGES)
def test_gasloc_with_an_adam_outer_optimizer_and_overlap(merge, tau):
    n, H, rounds = 4, 4, 3
    make = ALGORITHMS["gasloc_adam"]
    assert isinstance(make().outer_optimizer, functools.partial)
    _, replicas = replicas_for(make, n, H, overlap_steps=tau, overlap_merge=merge)
    lockstep(replicas, rounds * H + tau)
    assert check_rounds(make, replicas, tau, merge) == rounds
    state = replicas[0].driver.slots[0].state
    assert isinstance(state.optimizer, torch.optim.Adam) and state.optimizer.state  # Adam really stepped


# ---------------------------------------------------------------------------- 4. τ = 0 is the outer step


@pytest.mark.parametrize("name", ["noloco", "noloco_gamma0.9", "diloco", "gasloc_ring", "gasloc_complete"])
def test_a_synchronous_round_is_bitwise_the_blocking_outer_step(name):
    """The same training, once through the driver and once by calling ``algorithm.step`` (post, wait,
    apply) on a second network: bitwise equal after every step."""
    n, H, rounds = 4, 3, 3
    _, replicas = replicas_for(ALGORITHMS[name], n, H, overlap_steps=0)
    mirror = InProcessNetwork(n)

    def train(r: Replica) -> None:
        algorithm, transport = ALGORITHMS[name](), mirror.transport(r.i)
        weights = r.initial[0].clone()
        state = algorithm.init_state(weights.clone(), r.flats[0].shapes)
        target = torch.cat([t.reshape(-1) for t in r.targets[0]])
        for step in range(1, rounds * H + 1):
            r.step(0)
            weights.sub_((weights - target).mul_(inner_lr(step)))
            if step % H == 0:
                new, _ = blocking_outer_step(algorithm, state, weights, step // H - 1, transport)
                weights = new.clone()
                report = r.driver.reports[-1]
                assert (report.outer_step, report.overlap_steps, report.correction_norm) == (step // H - 1, 0, None)
            assert_same(r.flats[0].gather(), weights, f"replica {r.i} after step {step}")
            assert_same(r.driver.slots[0].state.anchor, state.anchor, f"anchor of replica {r.i} at {step}")

    run_in_threads([functools.partial(train, r) for r in replicas])
    assert all(len(r.driver.reports) == rounds for r in replicas)


# ---------------------------------------------------------------------------- 5. failures


@pytest.mark.parametrize(
    "name,n,failing",
    [("noloco", 2, {0}), ("gasloc_ring", 4, {0}), ("diloco", 3, {0, 2})],  # ring round 0: (0, 1), (2, 3)
)
def test_a_stopped_peer_fails_the_synchronous_round_of_its_group(name, n, failing):
    H = 2
    network, replicas = replicas_for(ALGORITHMS[name], n, H)
    network.fail(1)
    errors: dict[int, PeerError] = {}

    def train(r: Replica) -> None:
        try:
            r.run(H)
        except PeerError as error:
            errors[r.i] = error

    run_in_threads([functools.partial(train, r) for r in replicas if r.i != 1])  # replica 1 stopped
    assert set(errors) == failing
    for i, error in errors.items():
        assert f"Replica {i} could not complete its exchange with replica(s) [1]" in str(error)
        assert replicas[i].driver.slots[0].inner_steps == H and replicas[i].driver.reports == []
    for r in replicas:
        if r.i not in failing and r.i != 1:  # a group without replica 1 is not disturbed
            assert [x.peers for x in r.driver.reports] == [tuple(j for j in (2, 3) if j != r.i)]


@pytest.mark.parametrize("when", ["before_posting", "after_posting_on_a_held_link"])
@pytest.mark.parametrize("merge", MERGES)
def test_a_stopped_peer_fails_an_overlapped_round_at_its_landing(merge, when):
    H, tau = 4, 2
    network, (r0, r1) = replicas_for(NoLoCo, 2, H, overlap_steps=tau, overlap_merge=merge)
    if when == "before_posting":
        network.fail(1)
        r0.run(H + tau - 1)  # the start posts, the steps in between do not wait
    else:
        network.hold()
        lockstep([r0, r1], H)
        network.fail(1)
        r0.run(tau - 1)
    assert r0.driver.slots[0].in_flight is not None and network.waits == []
    with pytest.raises(PeerError, match=r"Replica 0 could not complete its exchange with replica\(s\) \[1\]"):
        r0.step()
    assert r0.driver.slots[0].inner_steps == H + tau and r0.driver.reports == []
    assert network.waits == [(0, (0, 1))]


@pytest.mark.parametrize("tau", [0, 1])
def test_a_peer_that_never_posts_raises_a_peer_error_after_the_timeout(tau):
    H = 2
    network = InProcessNetwork(2, timeout=0.2)
    r0 = Replica(0, network, NoLoCo(), H, overlap_steps=tau)  # replica 1 never runs
    r0.run(H + tau - 1)
    with pytest.raises(PeerError, match=r"replica\(s\) \[1\].*no answer within 0.2 s"):
        r0.step()
    assert r0.driver.reports == []


# ---------------------------------------------------------------------------- 6. several optimizers


@pytest.mark.parametrize("name", ["noloco", "diloco", "gasloc_random_pairs"])
def test_two_optimizers_keep_their_own_rounds(name):
    n, H, tau, rounds = 4, 3, 1, 3
    steps = rounds * H + tau
    _, replicas = replicas_for(ALGORITHMS[name], n, H, overlap_steps=tau, slots=2)
    for _ in range(steps):  # manual optimization: optimizer 0 steps, then optimizer 1
        for r in replicas:
            r.step(0)
            r.step(1)
    _, alone = replicas_for(ALGORITHMS[name], n, H, overlap_steps=tau)  # optimizer 0 only
    lockstep(alone, steps)
    for r, a in zip(replicas, alone):
        assert r.driver.rounds_started == [(k, t) for t in range(rounds) for k in (0, 1)]
        assert [(x.optimizer_index, x.outer_step) for x in r.driver.reports] == [
            (k, t) for t in range(rounds) for k in (0, 1)
        ]
        for slot in r.driver.slots:
            assert (slot.inner_steps, slot.outer_steps, slot.in_flight) == (steps, rounds, None)
        # optimizer 1's rounds leave optimizer 0 exactly as if it were alone
        assert_same(r.flats[0].gather(), a.flats[0].gather(), f"optimizer 0 of replica {r.i}")
        assert_same(r.driver.slots[0].state.anchor, a.driver.slots[0].state.anchor)
        for mine, theirs in zip(r.logs[0].landings, a.logs[0].landings):
            assert_same(mine.after, theirs.after)
            assert (mine.report.outer_step, mine.report.inner_step) == (theirs.report.outer_step,
                                                                        theirs.report.inner_step)
    for index in (0, 1):
        assert check_rounds(ALGORITHMS[name], replicas, tau, index=index) == rounds


# ---------------------------------------------------------------------------- 8. resume


def roundtrip(state_dict):
    """Through bytes, as a checkpoint file does (and loadable with weights_only)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def trace(replicas: list[Replica]) -> list[tuple[Tensor, Tensor]]:
    return [(r.flats[0].gather(), r.driver.slots[0].state.anchor.clone()) for r in replicas]


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("name", ["noloco", "noloco_gamma0.9", "diloco", "gasloc_random_pairs", "gasloc_adam"])
def test_resuming_with_a_round_in_flight_continues_bitwise(name, merge):
    n, H, tau = 4, 4, 2
    total, cut = 4 * H + tau, 2 * H + 1  # the checkpoint is taken between round 1's start and its landing
    kwargs = {"overlap_steps": tau, "overlap_merge": merge}
    _, whole = replicas_for(ALGORITHMS[name], n, H, **kwargs)
    expected = []
    for _ in range(total):
        lockstep(whole, 1)
        expected.append(trace(whole))

    _, first = replicas_for(ALGORITHMS[name], n, H, **kwargs)
    lockstep(first, cut)
    assert all(r.driver.slots[0].in_flight is not None for r in first)
    saved = [roundtrip(r.driver.state_dict()) for r in first]  # awaits the exchange in flight
    assert all(s[0]["in_flight"]["outer_step"] == 1 for s in saved)
    weights = [r.flats[0].gather() for r in first]
    _, resumed = replicas_for(ALGORITHMS[name], n, H, weights=[[w] for w in weights], **kwargs)  # a fresh network
    for r, s in zip(resumed, saved):
        r.driver.load_state_dict(s)
    for step in range(cut, total):
        lockstep(resumed, 1)
        lockstep(first, 1)  # taking the checkpoint changed nothing either
        for run in (resumed, first):
            for i, ((w, a), (w0, a0)) in enumerate(zip(trace(run), expected[step])):
                assert_same(w, w0, f"weights of replica {i} after step {step + 1}")
                assert_same(a, a0, f"anchor of replica {i} after step {step + 1}")
    for r, w in zip(resumed, whole):
        after_cut = [(x.outer_step, x.inner_step, x.overlap_steps, x.peers) for x in w.driver.reports
                     if x.inner_step > cut]
        assert [(x.outer_step, x.inner_step, x.overlap_steps, x.peers) for x in r.driver.reports] == after_cut
        assert len(after_cut) == 3


def test_loading_outer_state_for_other_parameters_fails_clearly():
    network = InProcessNetwork(2)
    saved = Replica(0, network, NoLoCo(), 2).driver.state_dict()
    other = OuterStepDriver.of(NoLoCo(), InProcessNetwork(2).transport(0), 2)
    other.add(FlatParameters([torch.nn.Parameter(torch.zeros(5))], CPU))
    with pytest.raises(ValueError, match=r"covers \[7\] parameters per optimizer, this model's optimizers \[5\]"):
        other.load_state_dict(saved)
    two = Replica(0, InProcessNetwork(2), NoLoCo(), 2, slots=2).driver
    with pytest.raises(ValueError, match=r"covers \[7\] .* optimizers \[7, 5\].*changed"):
        two.load_state_dict(saved)


# ---------------------------------------------------------------------------- 9. overlap_steps="auto"


@pytest.mark.filterwarnings("ignore:.*overlap_steps='auto'")
@pytest.mark.parametrize("agreed", [False, True])
@pytest.mark.parametrize("name", ["noloco", "diloco"])
def test_auto_overlap_starts_synchronous_then_overlaps_within_the_cap(name, agreed):
    n, H, rounds = 2, 8, 4
    cap = auto_cap(H, ALGORITHMS[name]().overlap_share)
    assert cap >= 2
    calls: dict[int, list[int]] = {i: [] for i in range(n)}
    returned: dict[int, list[int]] = {i: [] for i in range(n)}

    def agree_for(i: int) -> Callable[[int], int]:
        def agree(tau: int) -> int:
            calls[i].append(tau)
            returned[i].append(0 if tau == 0 else 1 + len(calls[i]) % 2)  # 1, 2, 1, ... whatever was chosen
            return returned[i][-1]
        return agree

    network = InProcessNetwork(n)
    replicas = [
        Replica(i, network, ALGORITHMS[name](), H, overlap_steps="auto", agree_overlap=agree_for(i) if agreed else None)
        for i in range(n)
    ]
    threaded(replicas, rounds * H + cap)  # the first round blocks: threads
    for r in replicas:
        reports = r.driver.reports
        taus = [x.overlap_steps for x in reports]
        assert len(reports) == rounds and taus[0] == 0
        assert all(1 <= tau <= cap for tau in taus[1:])
        assert [x.inner_step for x in reports] == [(t + 1) * H + tau for t, tau in enumerate(taus)]
        if agreed:
            assert calls[r.i][0] == 0 and all(0 <= tau <= cap for tau in calls[r.i])
            assert taus == returned[r.i] == [0, 1, 2, 1]
        else:
            assert calls[r.i] == []


# ---------------------------------------------------------------------------- 10. peer distance


@pytest.mark.parametrize("tau", [0, 2])
@pytest.mark.parametrize("name", ["noloco", "diloco"])
def test_peer_distance_is_half_the_distance_between_the_pair(name, tau):
    n, H, rounds = 2, 4, 3
    _, replicas = replicas_for(ALGORITHMS[name], n, H, overlap_steps=tau)
    for r in replicas:
        r.driver.track_norms = True
    (threaded if tau == 0 else lockstep)(replicas, rounds * H + tau)
    for t in range(rounds):
        s0, s1 = (r.logs[0].starts[t] for r in replicas)
        assert norm(s0 - s1) > 0
        for r in replicas:
            landing = r.logs[0].landings[t]
            before = r.initial[0] if t == 0 else r.logs[0].landings[t - 1].anchor
            report = landing.report
            assert report.peer_distance == pytest.approx(norm(s0 - s1) / 2, rel=1e-4)
            assert report.pseudo_gradient_norm == pytest.approx(norm(r.logs[0].starts[t] - before), rel=1e-5)
            assert report.update_norm == pytest.approx(norm(landing.anchor - before), rel=1e-5)


def test_a_replica_that_sits_a_round_out_has_no_peer_distance():
    n, H = 3, 2  # odd ring: round 0 pairs (0, 1), round 1 pairs (1, 2)
    _, replicas = replicas_for(ALGORITHMS["gasloc_ring"], n, H)
    for r in replicas:
        r.driver.track_norms = True
    threaded(replicas, 2 * H)
    alone = {(2, 0), (0, 1)}  # (replica, round)
    for r in replicas:
        for report in r.driver.reports:
            if (r.i, report.outer_step) in alone:
                assert report.peers == () and report.peer_distance is None and report.bytes_sent == 0
            else:
                assert len(report.peers) == 1 and report.peer_distance > 0
            assert report.pseudo_gradient_norm is not None and report.update_norm is not None


# ---------------------------------------------------------------------------- 11. end of training


@pytest.mark.parametrize("merge", MERGES)
def test_land_all_lands_a_round_early(merge):
    n, H, tau = 2, 4, 3
    _, replicas = replicas_for(NoLoCo, n, H, overlap_steps=tau, overlap_merge=merge,
                                 final_outer_step="outer")  # the plain outer step, landed early
    lockstep(replicas, H + 1)  # round 0 started at step H, due at H + 3
    algorithm = NoLoCo()
    sim = ReplicaSimulator(NoLoCo(), [replicas[0].initial[0]] * n, replicas[0].flats[0].shapes)
    snapshots = [r.logs[0].starts[0] for r in replicas]
    proxies = [algorithm.local_proxy(sim.states[i], snapshots[i], 2) for i in range(n)]
    new = sim.step(snapshots)
    for i, r in enumerate(replicas):
        before = r.flats[0].gather()
        r.driver.land_all()
        r.driver.land_all()  # nothing left: no second report
        (report,) = r.driver.reports
        assert (report.outer_step, report.inner_step, report.overlap_steps) == (0, H + 1, 1)
        assert r.driver.slots[0].in_flight is None
        assert_same(r.driver.slots[0].state.anchor, sim.anchors[i])
        merged = before + (new[i] - proxies[i]) if merge == "predict_correct" else new[i] + (before - snapshots[i])
        assert_same(r.flats[0].gather(), merged)


def test_abandon_all_drops_a_finished_round_quietly():
    H, tau = 4, 2
    _, (r0, r1) = replicas_for(NoLoCo, 2, H, overlap_steps=tau)
    lockstep([r0, r1], H + 1)
    weights, anchor = r0.flats[0].gather(), r0.driver.slots[0].state.anchor.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert r0.driver.abandon_all(timeout=1.0) == []
    assert r0.driver.slots[0].in_flight is None and r0.driver.reports == []
    assert_same(r0.flats[0].gather(), weights)  # nothing merged
    assert_same(r0.driver.slots[0].state.anchor, anchor)  # nothing committed


def test_abandon_all_drops_an_unfinished_round_with_a_warning():
    H, tau = 4, 2
    network = InProcessNetwork(2, timeout=3600.0)  # a wait would take this long: abandon_all must not
    _, (r0, r1) = replicas_for(NoLoCo, 2, H, network=network, overlap_steps=tau)
    network.hold()
    lockstep([r0, r1], H + 1)
    anchor = r0.driver.slots[0].state.anchor.clone()
    lingering: list = []
    with pytest.warns(UserWarning, match="outer step 0 was in flight and its exchange did not finish"):
        run_in_threads([lambda: lingering.extend([r0.driver.abandon_all(timeout=0.05)])])
    assert lingering == [[]]  # no thread left behind by the in-process transport
    assert r0.driver.slots[0].in_flight is None and r0.driver.reports == []
    assert_same(r0.driver.slots[0].state.anchor, anchor)
    network.release()  # the peer, whose payload went out, still lands its round
    r1.run(tau - 1)
    assert [(x.outer_step, x.overlap_steps) for x in r1.driver.reports] == [(0, tau)]


class StepClock:
    """A replica's clock that the test moves: by one unit at every inner step, and by an exchange's modelled
    time (``SlowLink``); the driver reads only it, so what "auto" measures does not depend on the machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowLink:
    """A replica's end of the in-process network whose every exchange takes ``seconds`` on its clock: it is
    seen done only once that long after posting, and a wait for it moves the clock there."""

    def __init__(self, inner, clock: StepClock, seconds: float) -> None:
        self.inner, self.clock, self.seconds = inner, clock, seconds
        self.replica, self.num_replicas, self.stats = inner.replica, inner.num_replicas, inner.stats
        self.slices_per_replica, self.may_go_alone = 1, False

    def _slow(self, pending):
        link, posted = self, self.clock.now

        class Slow:
            def __getattr__(self, name):
                return getattr(pending, name)

            def watch(self):
                pending.watch()
                return self

            def done(self) -> bool:
                return link.clock.now >= posted + link.seconds and pending.done()

            def wait(self):
                link.clock.now = max(link.clock.now, posted + link.seconds)
                return pending.wait()

        return Slow()

    def start_group_sum(self, *args, **kwargs):
        return self._slow(self.inner.start_group_sum(*args, **kwargs))

    def start_all_reduce_sum(self, *args, **kwargs):
        return self._slow(self.inner.start_all_reduce_sum(*args, **kwargs))

    def resolved(self, total, peers=()):
        return self.inner.resolved(total, peers)


class ClockedReplica(Replica):
    """A replica whose clock moves one unit at every inner step."""

    def __init__(self, *args, clock: StepClock, **kwargs) -> None:
        super().__init__(*args, clock=clock, **kwargs)
        self.clock = clock

    def step(self, index: int = 0) -> None:
        self.clock.now += 1.0
        super().step(index)


def test_auto_overlap_caps_tau_and_warns_when_the_link_is_slower_than_the_cap_can_hide():
    # Every exchange takes 100 units of the replicas' clocks, an inner step 1: "auto" measures round 0
    # (synchronous), then needs 100 steps, far more than the cap, and overlaps as much as the cap allows,
    # warning once per replica that the rest is waited for at the landing.
    n, H = 2, 8
    cap = auto_cap(H, NoLoCo().overlap_share)
    network = InProcessNetwork(n, timeout=10.0)
    clocks = [StepClock() for _ in range(n)]
    replicas = [ClockedReplica(i, network, NoLoCo(), H, overlap_steps="auto", clock=clocks[i],
                               transport=SlowLink(network.transport(i), clocks[i], 100.0)) for i in range(n)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threaded(replicas, 3 * H + cap)
    for r in replicas:
        assert [x.overlap_steps for x in r.driver.reports] == [0, cap, cap]
        assert r.driver.slots[0].auto.needed == 100  # ⌈100 units / 1 unit a step⌉, exactly
        assert [x.comm_seconds for x in r.driver.reports] == [100.0, 100.0 - cap, 100.0 - cap]  # waited at landing
    messages = [str(w.message) for w in caught if "overlap_steps='auto' needs about" in str(w.message)]
    assert sorted(m.split(":")[0] for m in messages) == ["Replica 0", "Replica 1"]


def test_final_outer_step_has_one_default_everywhere():
    """A driver-only user gets what the strategies and the simulator do at the end of training."""
    import inspect

    from lightning_loco.simulator import TrainingSimulator
    from lightning_loco.trainer.base import OuterStepStrategy

    defaults = {cls.__name__: inspect.signature(cls).parameters["final_outer_step"].default
                for cls in (Options, OuterStepStrategy, TrainingSimulator)}
    assert set(defaults.values()) == {"average"}, defaults
