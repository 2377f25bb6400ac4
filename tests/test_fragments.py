"""Streaming fragments (``fragments=F``) in the driver, over the in-process transport: the layout, the
argument checks, F = 1 against the unfragmented path, F = H against per-step rounds written out by
hand, F fragments against F independent runs, resume with a fragment's round in flight, the end of
training.

No processes and no Lightning. Every replica trains a closed-form model: θ ← θ − lr(s)·(θ − target_i),
elementwise, with a learning rate that depends on the step s, so fragments of the model evolve
independently between their rounds and any misplaced round or outer state shows at once.
"""

from __future__ import annotations

import functools
import io
import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.driver.fragments import fragment_algorithm, fragment_seed, layout
from lightning_loco.driver.rounds import step as blocking_outer_step
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.replica.options import WireConfig
from lightning_loco.rules import build_options
from lightning_loco.transport import InProcessNetwork

from oracle import ReplicaSimulator

CPU = torch.device("cpu")
SHAPES = ((3,), (2, 2), (5,), (4,), (1,), (6,), (2, 3), (3,))  # eight parameters of unequal sizes
JOIN_S = 30.0  # a guard against a deadlock, not a measurement


def inner_lr(step: int) -> float:
    return 0.1 + 0.02 * (step % 3)


def initial(shapes=SHAPES) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in shapes]


def targets(replica: int, shapes=SHAPES) -> list[Tensor]:
    g = torch.Generator().manual_seed(1000 + replica)
    return [2 * torch.randn(shape, generator=g) for shape in shapes]


class Replica:
    """One replica: its parameters, its targets and a driver over them (one optimizer)."""

    def __init__(self, i: int, network: InProcessNetwork, algorithm, sync_every: int, params=None, aims=None,
                 **driver_kwargs: Any) -> None:
        self.i = i
        self.params = [torch.nn.Parameter(w.clone()) for w in (params if params is not None else initial())]
        self.targets = aims if aims is not None else targets(i)
        self.driver = OuterStepDriver.of(algorithm, network.transport(i), sync_every, **driver_kwargs)
        self.flat = FlatParameters(self.params, CPU)
        self.driver.add(self.flat)
        self.steps = 0
        self.trace: list[Tensor] = []  # the live weights after every step

    def step(self, last: bool = False) -> None:
        self.steps += 1
        with torch.no_grad():
            for p, target in zip(self.params, self.targets):
                p.sub_((p - target).mul_(inner_lr(self.steps)))
        self.driver.after_inner_step(0, last=last)
        self.trace.append(self.flat.gather())

    def run(self, steps: int, last_at: int = -1) -> None:
        for _ in range(steps):
            self.step(last=self.steps + 1 == last_at)


def replicas(make, n: int, H: int, **kwargs: Any) -> list[Replica]:
    network = InProcessNetwork(n, timeout=10.0)
    return [Replica(i, network, make(), H, **kwargs) for i in range(n)]


def threaded(group: list[Replica], steps: int, last_at: int = -1) -> None:
    """Each replica in a thread of its own (a synchronous round blocks until its group has posted)."""
    errors: list[BaseException] = []

    def target(r: Replica) -> None:
        try:
            r.run(steps, last_at)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            errors.append(error)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in group]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a deadlock"
    if errors:
        raise errors[0]


def lockstep(group: list[Replica], steps: int, last_at: int = -1) -> None:
    for _ in range(steps):
        for r in group:
            r.step(last=r.steps + 1 == last_at)


def run(group: list[Replica], steps: int, tau: int, last_at: int = -1) -> None:
    (lockstep if tau else threaded)(group, steps, last_at)


def assert_same(actual: Tensor, expected: Tensor, what: str = "") -> None:
    assert torch.equal(actual, expected), f"{what}: max difference {(actual - expected).abs().max().item()}"


def boundaries(F: int, shapes=SHAPES) -> list[tuple[int, int]]:
    """Fragment f's values in the flat vector, from the layout of the parameters."""
    offsets = list(itertools.accumulate([0] + [torch.Size(s).numel() for s in shapes]))
    return [(offsets[a], offsets[b]) for a, b in layout([torch.Size(s).numel() for s in shapes], F)]


# ---------------------------------------------------------------------------- 1. the layout


def test_the_layout_is_contiguous_whole_parameters_with_the_smallest_largest_fragment():
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        count = int(torch.randint(1, 9, (1,), generator=g))
        numels = torch.randint(1, 20, (count,), generator=g).tolist()
        for F in range(1, count + 1):
            ranges = layout(numels, F)
            assert len(ranges) == F and ranges[0][0] == 0 and ranges[-1][1] == count
            assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
            largest = max(sum(numels[a:b]) for a, b in ranges)
            best = min(  # every way to cut the list into F contiguous non-empty pieces
                max(sum(numels[a:b]) for a, b in zip((0,) + cuts, cuts + (count,)))
                for cuts in itertools.combinations(range(1, count), F - 1)
            )
            assert largest == best, (numels, F, ranges)


def test_the_layout_of_equal_parameters_is_equal_fragments_and_too_few_parameters_fail():
    assert layout([10] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layout([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="fragments=4 needs at least 4 parameters per optimizer.*fragments <= 3"):
        layout([5, 5, 5], 4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"fragments": 0}, "fragments must be an integer >= 1, got 0"),
        ({"fragments": True}, "fragments must be an integer >= 1"),
        ({"fragments": 3}, r"fragments=3 must divide sync_every=8.*Use one of \[1, 2, 4, 8\]"),
        ({"fragments": 4, "overlap_steps": 2}, "overlap_steps=2 must be smaller than sync_every / fragments = 2"),
        ({"fragments": 2, "pacing": 1.0}, "fragments=2 does not work with pacing"),
        ({"fragments": 2, "elastic": ElasticConfig("localhost:1")}, "fragments=2 does not work with elastic replicas"),
        ({"fragments": 2, "replica_sharding": "fsdp"}, "fragments=2 does not work with replica_sharding"),
    ],
)
def test_fragments_that_cannot_work_are_refused_saying_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_options(NoLoCo(), 8, **kwargs)


def test_the_driver_s_options_check_fragments_before_anything_runs():
    with pytest.raises(ValueError, match="must divide sync_every=6"):
        OuterStepDriver(build_options(NoLoCo(), 6, fragments=4), InProcessNetwork(2).transport(0))
    with pytest.raises(ValueError, match="overlap_steps=3 must be smaller than sync_every / fragments = 3"):
        OuterStepDriver(build_options(NoLoCo(), 6, overlap_steps=3, fragments=2), InProcessNetwork(2).transport(0))
    driver = OuterStepDriver.of(NoLoCo(), InProcessNetwork(2).transport(0), 4, fragments=4)
    with pytest.raises(ValueError, match="needs at least 4 parameters"):
        driver.add(FlatParameters([torch.nn.Parameter(torch.zeros(9))], CPU))


def test_each_fragment_draws_its_own_peers_and_fragment_0_keeps_the_seed():
    noloco = NoLoCo(seed=5)
    assert fragment_algorithm(noloco, 0) is noloco and fragment_seed(5, 0) == 5
    diloco = DiLoCo()
    assert fragment_algorithm(diloco, 3) is diloco  # no seed: nothing to draw
    twins = [fragment_algorithm(noloco, f) for f in range(4)]
    assert len({twin.seed for twin in twins}) == 4 and noloco.seed == 5
    schedules = [tuple(twin.schedule(t, 8).groups for t in range(6)) for twin in twins]
    assert len(set(schedules)) == 4  # four fragments, four different sequences of pairs
    gasloc = fragment_algorithm(GASLoC(topology="random_pairs", seed=5), 1)
    assert gasloc.schedule(0, 8) == GASLoC(topology="random_pairs", seed=fragment_seed(5, 1)).schedule(0, 8)


# ---------------------------------------------------------------------------- 2. F = 1 is the unfragmented path


@pytest.mark.parametrize("name", ["noloco", "diloco", "gasloc"])
def test_one_fragment_is_bitwise_the_blocking_outer_step(name):
    """``fragments=1`` through the driver against ``rounds.step`` (post, wait, apply), which knows
    nothing of fragments, on a second network: bitwise after every step."""
    make = {"noloco": lambda: NoLoCo(seed=2), "diloco": DiLoCo, "gasloc": lambda: GASLoC(seed=2)}[name]
    n, H, rounds = 4, 3, 3
    group = replicas(make, n, H, fragments=1)
    mirror = InProcessNetwork(n)

    def train(r: Replica) -> None:
        algorithm, transport = make(), mirror.transport(r.i)
        weights = torch.cat([w.reshape(-1) for w in initial()])
        state = algorithm.init_state(weights.clone(), list(r.flat.shapes))
        target = torch.cat([t.reshape(-1) for t in r.targets])
        for step in range(1, rounds * H + 1):
            r.step()
            weights.sub_((weights - target).mul_(inner_lr(step)))
            if step % H == 0:
                weights = blocking_outer_step(algorithm, state, weights, step // H - 1, transport)[0].clone()
            assert_same(r.trace[-1], weights, f"replica {r.i} after step {step}")
            assert_same(r.driver.slots[0].state.anchor, state.anchor, f"anchor of replica {r.i} at step {step}")

    errors: list[BaseException] = []
    threads = [threading.Thread(target=lambda r=r: _catch(errors, train, r), daemon=True) for r in group]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not errors, errors[0]
    assert all(len(r.driver.slots) == 1 and len(r.driver.reports) == rounds for r in group)
    assert all(x.fragment == 0 for r in group for x in r.driver.reports)


def _catch(errors: list[BaseException], function: Callable[[Replica], None], r: Replica) -> None:
    try:
        function(r)
    except BaseException as error:  # noqa: BLE001 - handed back to the test
        errors.append(error)


# ---------------------------------------------------------------------------- 3. F = H: a fragment every step


@pytest.mark.parametrize("name", ["diloco", "noloco"])
def test_as_many_fragments_as_steps_are_one_fragment_round_per_step(name):
    """F = H: at step s the round of fragment s mod H, each fragment with its own outer state (and
    for NoLoCo its own peers), written out once more from the algorithm's maths on slices."""
    make = {"diloco": DiLoCo, "noloco": lambda: NoLoCo(seed=7)}[name]
    n, H, steps = 4, 4, 13
    group = replicas(make, n, H, fragments=H)
    threaded(group, steps)

    cuts = boundaries(H)
    weights = [torch.cat([w.reshape(-1) for w in initial()]) for _ in range(n)]
    flat_targets = [torch.cat([t.reshape(-1) for t in targets(i)]) for i in range(n)]
    shapes = [[torch.Size(s) for s in SHAPES[a:b]] for a, b in layout([torch.Size(s).numel() for s in SHAPES], H)]
    sims = [
        ReplicaSimulator(fragment_algorithm(make(), f), [weights[0][a:b].clone()] * n, shapes[f])
        for f, (a, b) in enumerate(cuts)
    ]
    for s in range(1, steps + 1):
        for i in range(n):
            weights[i].sub_((weights[i] - flat_targets[i]).mul_(inner_lr(s)))
        f = s % H  # fragment f's rounds are at f·H/F + kH = f + kH
        a, b = cuts[f]
        for i, new in enumerate(sims[f].step([w[a:b] for w in weights])):
            weights[i][a:b] = new
        for i, r in enumerate(group):
            assert_same(r.trace[s - 1], weights[i], f"replica {i} after step {s}")
    for i, r in enumerate(group):
        assert [slot.outer_steps for slot in r.driver.slots] == [3, 4, 3, 3]
        assert r.driver.rounds_started == [(0, t) for t in range(3)]  # once per H steps: fragment 0's rounds
        for f, slot in enumerate(r.driver.slots):
            assert_same(slot.state.anchor, sims[f].anchors[i], f"anchor of fragment {f} of replica {i}")
        assert [(x.fragment, x.outer_step, x.inner_step) for x in r.driver.reports] == [
            (s % H, (s - s % H) // H - (s % H == 0), s) for s in range(1, steps + 1)
        ]


# ---------------------------------------------------------------------------- 4. F fragments, F runs


ALONE_CASES: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
    "noloco": (lambda: NoLoCo(seed=3), {}),
    "noloco_gamma0.9": (lambda: NoLoCo(averaging_rate=0.9, seed=3), {}),
    "gasloc_adam": (lambda: GASLoC(seed=3, outer_optimizer=functools.partial(torch.optim.Adam, lr=0.01)), {}),
    # error feedback per fragment: each fragment keeps its own residual
    "diloco_int8_feedback": (DiLoCo, {"wire": WireConfig("int8", block_size=4, error_feedback=True)}),
}


@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("name", list(ALONE_CASES))
def test_fragments_of_a_forced_pair_are_independent_runs_on_the_fragments(name, tau):
    """Two replicas (every round pairs them, whatever the seed) with F = 4 fragments train exactly as
    four independent unfragmented runs on the fragments' parameters, each run's rounds falling on its
    fragment's steps (its step count starts H − f·H/F short of its first round)."""
    make, kwargs = ALONE_CASES[name]
    n, H, F, steps = 2, 8, 4, 29
    group = replicas(make, n, H, fragments=F, overlap_steps=tau, **kwargs)
    run(group, steps, tau)

    whole = initial()
    ranges = layout([p.numel() for p in whole], F)
    for f, (a, b) in enumerate(ranges):
        network = InProcessNetwork(n, timeout=10.0)
        alone = [Replica(i, network, make(), H, params=whole[a:b], aims=targets(i)[a:b], overlap_steps=tau, **kwargs)
                 for i in range(n)]
        for r in alone:
            r.driver.slots[0].inner_steps = (H - f * H // F) % H
        run(alone, steps, tau)
        cut = boundaries(F)[f]
        for i in range(n):
            for s in range(steps):
                where = f"fragment {f}, replica {i}, step {s + 1}"
                assert_same(group[i].trace[s][cut[0]:cut[1]], alone[i].trace[s], where)
            fragment = group[i].driver.slots[f]
            assert_same(fragment.state.anchor, alone[i].driver.slots[0].state.anchor, f"anchor of fragment {f}")
            assert fragment.outer_steps == alone[i].driver.slots[0].outer_steps == (steps - f * H // F) // H + (f > 0)
            ours = [x for x in group[i].driver.reports if x.fragment == f]
            assert [(x.outer_step, x.inner_step, x.bytes_sent) for x in ours] == [
                (x.outer_step, x.inner_step - (H - f * H // F) % H, x.bytes_sent) for x in alone[i].driver.reports
            ]


def test_the_bytes_of_one_exchange_are_a_fragments_share():
    """NoLoCo in pairs sends one copy of what a round covers: the whole model at F = 1, the fragment's
    parameters at F > 1, and over H steps the same bytes in all (F rounds)."""
    numels = [torch.Size(s).numel() for s in SHAPES]
    for F in (1, 2, 4, 8):
        group = replicas(lambda: NoLoCo(seed=1), 4, 8, fragments=F)
        threaded(group, 16)
        sent = [x.bytes_sent for x in group[0].driver.reports]
        assert len(sent) == 2 * F and sum(sent) == 2 * sum(numels) * 4
        assert max(sent) == max(sum(numels[a:b]) for a, b in layout(numels, F)) * 4
        assert sorted({x.fragment for x in group[0].driver.reports}) == list(range(F))


# ---------------------------------------------------------------------------- 5. checkpoints


def roundtrip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", ["noloco", "diloco_int8_feedback"])
def test_resuming_with_a_fragments_round_in_flight_continues_bitwise(name):
    make, kwargs = ALONE_CASES[name]
    n, H, F, tau = 2, 8, 4, 1
    total, cut = 3 * H, H + 2  # fragment 1's round started at step H + 2 and lands at H + 3
    kwargs = dict(kwargs, overlap_steps=tau, fragments=F)
    whole = replicas(make, n, H, **kwargs)
    lockstep(whole, total)

    first = replicas(make, n, H, **kwargs)
    lockstep(first, cut)
    assert all([s.in_flight is not None for s in r.driver.slots] == [False, True, False, False] for r in first)
    saved = [roundtrip(r.driver.state_dict()) for r in first]
    assert all(s[1]["in_flight"]["outer_step"] == 1 and s[1]["fragments"] == F for s in saved)
    network = InProcessNetwork(n, timeout=10.0)
    resumed = [Replica(i, network, make(), H, params=[p.detach().clone() for p in r.params], **kwargs)
               for i, r in enumerate(first)]
    for r, s in zip(resumed, saved):
        r.driver.load_state_dict(s)
        r.steps = cut
    lockstep(resumed, total - cut)
    lockstep(first, total - cut)  # taking the checkpoint changed nothing either
    for run_ in (resumed, first):
        for i, r in enumerate(run_):
            assert_same(r.trace[-1], whole[i].trace[-1], f"replica {i} at the end")
            for f, (slot, expected) in enumerate(zip(r.driver.slots, whole[i].driver.slots)):
                assert_same(slot.state.anchor, expected.state.anchor, f"anchor of fragment {f}")
                assert slot.outer_steps == expected.outer_steps
    for i, r in enumerate(resumed):
        for s in range(total - cut):
            assert_same(r.trace[s], whole[i].trace[cut + s], f"replica {i} after step {cut + s + 1}")


def test_a_checkpoint_of_other_fragments_fails_clearly():
    saved = replicas(NoLoCo, 1, 4, fragments=2)[0].driver.state_dict()
    other = replicas(NoLoCo, 1, 4, fragments=4)[0].driver
    with pytest.raises(ValueError, match="saved with fragments=2, this run has fragments=4. Resume with fragments=2"):
        other.load_state_dict(saved)
    plain = replicas(NoLoCo, 1, 4)[0].driver
    with pytest.raises(ValueError, match="saved with fragments=2, this run has fragments=1"):
        plain.load_state_dict(saved)


# ---------------------------------------------------------------------------- 6. the end of training


@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("final_outer_step", ["average", "outer"])
def test_the_last_step_lands_a_round_of_every_fragment(final_outer_step, tau):
    """The step that ends training starts a round of every fragment not in flight (F > 1), and every
    round lands, as final with ``final_outer_step="average"``: a forced pair then ends with equal
    weights on every fragment (NoLoCo's final weights are the pair's mean)."""
    n, H, F, steps = 2, 8, 4, 13  # 13 is nobody's round; with τ = 1 fragment 2's round of step 12 lands at 13
    group = replicas(lambda: NoLoCo(seed=3), n, H, fragments=F, overlap_steps=tau, final_outer_step=final_outer_step)
    run(group, steps, tau, last_at=steps)
    for r in group:
        r.driver.land_all()
    for r in group:
        assert all(slot.in_flight is None for slot in r.driver.slots)
        last = {x.fragment: x for x in r.driver.reports}  # each fragment's last round
        assert sorted(last) == list(range(F))
        assert all(x.inner_step == steps and x.final == (final_outer_step == "average") for x in last.values())
        assert len(r.driver.reports) == 6 + F  # 2, 4, 6, 8, 10, 12, then one per fragment at 13
    if final_outer_step == "average":
        a, b = group[0].flat.gather(), group[1].flat.gather()
        if tau == 0:
            assert_same(a, b, "the pair's final weights")
        else:  # merged at the landing: θ + (final − φ̂) with θ = φ̂, to within rounding
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for r in group:  # a run that goes on after all: the outer step's own weights come back
        assert r.driver.restore_outer_weights() == (final_outer_step == "average")


def test_one_fragment_starts_no_extra_round_at_the_last_step():
    group = replicas(lambda: NoLoCo(seed=3), 2, 4, fragments=1)
    threaded(group, 6, last_at=6)
    assert [x.inner_step for x in group[0].driver.reports] == [4]


# ---------------------------------------------------------------------------- 7. several optimizers, "auto"


def test_each_optimizer_has_its_own_fragments():
    """Two optimizers with F = 2 in one driver train as each optimizer alone in a driver of its own."""
    n, H, F, steps = 2, 4, 2, 11
    network = InProcessNetwork(n, timeout=10.0)
    both = []
    for i in range(n):
        driver = OuterStepDriver.of(NoLoCo(seed=1), network.transport(i), H, overlap_steps=1, fragments=F)
        optimizers = [Replica(i, InProcessNetwork(n), NoLoCo(), H, params=initial()[a:b], aims=targets(i)[a:b])
                      for a, b in ((0, 4), (4, 8))]
        for r in optimizers:  # one driver for both optimizers, in place of each one's own
            r.driver = driver
            driver.add(r.flat)
        both.append(optimizers)
    for _ in range(steps):
        for optimizers in both:
            for index, r in enumerate(optimizers):
                r.steps += 1
                with torch.no_grad():
                    for p, target in zip(r.params, r.targets):
                        p.sub_((p - target).mul_(inner_lr(r.steps)))
                r.driver.after_inner_step(index)
    assert [len(s) for s in both[0][0].driver.optimizer_slots] == [F, F]
    assert both[0][0].driver.params_of(1) == both[0][1].params
    for index, (a, b) in enumerate(((0, 4), (4, 8))):
        network = InProcessNetwork(n, timeout=10.0)
        alone = [Replica(i, network, NoLoCo(seed=1), H, params=initial()[a:b], aims=targets(i)[a:b], overlap_steps=1,
                         fragments=F) for i in range(n)]
        lockstep(alone, steps)
        for i in range(n):
            assert_same(both[i][index].flat.gather(), alone[i].flat.gather(), f"optimizer {index} of replica {i}")
            mine = [(x.fragment, x.outer_step, x.inner_step) for x in both[i][0].driver.reports
                    if x.optimizer_index == index]
            assert mine == [(x.fragment, x.outer_step, x.inner_step) for x in alone[i].driver.reports]


@pytest.mark.parametrize("name,cap", [("noloco", 2), ("diloco", 1)])
def test_auto_overlap_is_capped_by_the_steps_between_fragments(name, cap):
    driver = OuterStepDriver.of(NoLoCo() if name == "noloco" else DiLoCo(), InProcessNetwork(2).transport(0), 16,
                             overlap_steps="auto", fragments=4)
    driver.add(FlatParameters([torch.nn.Parameter(torch.zeros(3)) for _ in range(4)], CPU))
    assert [slot.auto.cap for slot in driver.slots] == [cap] * 4  # H/2 or H/4 of H/F = 4 steps
