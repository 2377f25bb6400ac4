"""GASLoC's two forms: momentum on the mixed iterates (``momentum_on="mixed"``, our reconstruction) and
on the sent iterates (``momentum_on="sent"``, the public summary of the paper). No processes.

The reference is the summary's formula itself, stacked over replicas, in float64:

    y_t = θ_t + η·g_t;   θ_{t+1} = y_t − α·Λ_t·y_t + γ·(y_t − y_{t−1}),   y_{−1} = θ_0
    Λ_t = ½ Σ_{(i,j) ∈ E_t} λ_ij (e_i − e_j)(e_i − e_j)ᵀ,  λ_ij = 1,

E_t holding both orientations of each edge of round t's matching (so Λ_t = D − A, the usual graph
Laplacian); the complete topology mixes with the exact average J = 11ᵀ/N instead of I − α·Λ.
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from test_elastic_plugin import H as ELASTIC_H
from test_elastic_plugin import Runner, elastic_runner, in_threads

from lightning_loco import GASLoCStrategy
from lightning_loco.algorithms import DiLoCo, GASLoC
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.plugin import ElasticPlugin
from lightning_loco.elastic.transport import ElasticTransport
from lightning_loco.transport import InProcessNetwork

from elastic_fakes import FakeMembership, Hub, Script
from oracle import ReplicaSimulator
from test_driver import Replica, check_rounds, lockstep, replicas_for, run_in_threads, threaded

ETA, GAMMA, ALPHA = 0.8, 0.6, 0.3
ATOL = 2e-6  # float32 against float64 over a few rounds of values of order one (seen: 2e-7)
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- the closed form


def laplacian(groups, n: int) -> torch.Tensor:
    """Λ = ½ Σ_{(i,j) ∈ E} (e_i − e_j)(e_i − e_j)ᵀ over both orientations of every edge (λ_ij = 1)."""
    lap = torch.zeros(n, n, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    for group in groups:
        for i in group:
            for j in group:
                if i != j:
                    lap += 0.5 * torch.outer(eye[i] - eye[j], eye[i] - eye[j])
    return lap


def mixing(algorithm: GASLoC, t: int, n: int) -> torch.Tensor:
    """The round's mixing matrix: I − α·Λ_t, or J on the complete topology."""
    if algorithm.topology == "complete":
        return torch.full((n, n), 1.0 / n, dtype=torch.float64)
    return torch.eye(n, dtype=torch.float64) - algorithm.gossip_step * laplacian(algorithm.schedule(t, n).groups, n)


class SentForm:
    """The summary's update on stacked float64 rows (one per replica)."""

    def __init__(self, algorithm: GASLoC, theta0: torch.Tensor) -> None:
        self.algorithm, self.theta = algorithm, theta0.double().clone()
        self.y_prev = self.theta.clone()  # y_{−1} = θ_0

    def sent(self, live: torch.Tensor) -> torch.Tensor:
        return self.theta + self.algorithm.outer_lr * (live.double() - self.theta)  # y = θ + η·g

    def proxy(self, live: torch.Tensor) -> torch.Tensor:
        """Every received y_j replaced by the replica's own: x_i = y_i, so y + γ·(y − y_prev)."""
        y = self.sent(live)
        return y + self.algorithm.outer_momentum * (y - self.y_prev)

    def mix(self, live: torch.Tensor, t: int) -> torch.Tensor:
        return mixing(self.algorithm, t, len(self.theta)) @ self.sent(live)

    def step(self, live: torch.Tensor, t: int) -> torch.Tensor:
        y = self.sent(live)
        self.theta = mixing(self.algorithm, t, len(y)) @ y + self.algorithm.outer_momentum * (y - self.y_prev)
        self.y_prev = y
        return self.theta


def random_start(n: int, size: int, seed: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)).expand(n, size).clone()


def inner_phases(out: list[torch.Tensor], g: torch.Generator) -> list[torch.Tensor]:
    """Random pseudo-gradients: θ_H = θ + g with g independent of θ."""
    return [w + 0.1 * torch.randn(w.shape, generator=g) for w in out]


def sent(**kwargs) -> GASLoC:
    return GASLoC(momentum_on="sent", **kwargs)


# ---------------------------------------------------------------------------- the maths


@pytest.mark.parametrize("topology,n", [("random_pairs", 6), ("random_pairs", 7), ("ring", 5), ("ring", 8),
                                        ("exponential", 8), ("complete", 5)])
def test_sent_form_equals_the_closed_form(topology, n):
    algorithm = sent(outer_lr=ETA, outer_momentum=GAMMA, gossip_step=ALPHA, topology=topology, seed=1)
    start = random_start(n, 9, seed=1)
    sim, ref = ReplicaSimulator(algorithm, list(start)), SentForm(algorithm, start)
    g = torch.Generator().manual_seed(2)
    out = list(start)
    for t in range(8):
        live = inner_phases(out, g)
        out = sim.step(live)
        expected = ref.step(torch.stack(live), t)
        assert torch.allclose(torch.stack(out).double(), expected, atol=ATOL, rtol=0), t
        assert torch.allclose(torch.stack([s.y_prev for s in sim.states]).double(), ref.y_prev, atol=ATOL, rtol=0)
        assert all(s.y_prev.dtype == torch.float32 for s in sim.states)
    # momentum on the sent iterates is not momentum on the mixed ones: the forms part ways
    mixed = ReplicaSimulator(GASLoC(outer_lr=ETA, outer_momentum=GAMMA, gossip_step=ALPHA, topology=topology, seed=1),
                             list(start))
    g = torch.Generator().manual_seed(2)
    out = list(start)
    for _ in range(8):
        out = mixed.step(inner_phases(out, g))
    assert not torch.allclose(torch.stack(out).double(), ref.theta, atol=1e-3)


@pytest.mark.parametrize("momentum_on", ["mixed", "sent"])
def test_one_worker_both_forms_are_the_same_map_nesterov_diloco(momentum_on):
    """N = 1: Λ = 0 and x = y, so both forms are θ_{t+1} = y_t + γ·(y_t − y_{t−1}): the same map. It is
    DiLoCo with outer SGD(lr=η, momentum=γ, Nesterov) on the pseudo-gradient, and the sent iterates
    follow heavy ball, y_t = y_{t−1} + γ·(y_{t−1} − y_{t−2}) + η·g_t. The forms compute it along
    different float32 paths (torch's Nesterov buffer against the difference y − y_prev): equal to
    rounding, not bitwise."""
    other_form = "sent" if momentum_on == "mixed" else "mixed"
    start = random_start(1, 7, seed=3)
    gasloc = ReplicaSimulator(GASLoC(outer_lr=ETA, outer_momentum=GAMMA, momentum_on=momentum_on), list(start))
    other = ReplicaSimulator(GASLoC(outer_lr=ETA, outer_momentum=GAMMA, momentum_on=other_form), list(start))
    diloco = ReplicaSimulator(DiLoCo(outer_lr=ETA, outer_momentum=GAMMA, nesterov=True), list(start))
    g = torch.Generator().manual_seed(4)
    out = list(start)
    y_prev2 = y_prev = start[0].double()  # y_{−2} = y_{−1} = θ_0: no velocity at the start
    for t in range(10):
        live = inner_phases(out, g)
        anchor = gasloc.states[0].anchor.double()
        assert torch.allclose(anchor, y_prev + GAMMA * (y_prev - y_prev2), atol=ATOL), t  # θ_t
        y = anchor + ETA * (live[0].double() - anchor)  # y_t = θ_t + η·g_t, what the replica sends
        out, twin, ref = gasloc.step(live), other.step(live), diloco.step(live)
        assert torch.allclose(out[0], twin[0], atol=ATOL), t
        assert torch.allclose(out[0], ref[0], atol=ATOL), t
        y_prev2, y_prev = y_prev, y


def nesterov_and_heavy_ball(mean, d, state, gamma):
    """One outer SGD step (lr 1, momentum γ) of the mean with gradient d, both ways; state: the buffers."""
    buf = d if state["buf"] is None else gamma * state["buf"] + d
    state["buf"] = buf
    return mean - (d + gamma * buf), mean - buf


@pytest.mark.parametrize("momentum_on", ["mixed", "sent"])
@pytest.mark.parametrize("topology,n", [("complete", 5), ("random_pairs", 6), ("ring", 5)])
def test_the_mean_over_replicas_follows_nesterov_diloco(topology, n, momentum_on):
    """1ᵀΛ = 0 (and J is doubly stochastic), so the mean of θ_{t+1} is ȳ_t + γ·(ȳ_t − ȳ_{t−1}) in both
    forms: the one-worker map on the mean pseudo-gradient, Nesterov DiLoCo, not heavy ball. On the
    complete graph only the "mixed" form keeps the replicas equal (exactly DiLoCo)."""
    algorithm = GASLoC(outer_lr=ETA, outer_momentum=GAMMA, gossip_step=0.25, topology=topology, seed=2,
                       momentum_on=momentum_on)
    start = random_start(n, 12, seed=2)
    sim = ReplicaSimulator(algorithm, list(start))
    g = torch.Generator().manual_seed(5)
    nesterov = heavy_ball = start[0].double()
    buffers = {"buf": None}
    out = list(start)
    for t in range(8):
        live = inner_phases(out, g)
        d = -ETA * sum(w.double() - s.anchor.double() for w, s in zip(live, sim.states)) / n  # −η·ḡ
        nesterov, _ = nesterov_and_heavy_ball(nesterov, d, buffers, GAMMA)
        heavy_ball = heavy_ball - buffers["buf"]
        out = sim.step(live)
        assert torch.allclose(sum(a.double() for a in sim.anchors) / n, nesterov, atol=ATOL), t
    assert not torch.allclose(sum(a.double() for a in sim.anchors) / n, heavy_ball, atol=1e-3)
    all_equal = all(torch.equal(out[0], w) for w in out[1:])
    assert all_equal == (topology == "complete" and momentum_on == "mixed")


@pytest.mark.parametrize("topology,n", [("random_pairs", 6), ("ring", 5), ("exponential", 4), ("complete", 4)])
def test_without_momentum_the_forms_are_bitwise_the_same(topology, n):
    make = functools.partial(GASLoC, outer_lr=ETA, outer_momentum=0.0, gossip_step=ALPHA, topology=topology)
    start = random_start(n, 9, seed=6)
    mixed, sent_ = ReplicaSimulator(make(), list(start)), ReplicaSimulator(make(momentum_on="sent"), list(start))
    g = torch.Generator().manual_seed(7)
    out = list(start)
    for t in range(6):
        live = inner_phases(out, g)
        for i in range(n):
            a, b = mixed.algorithm.local_proxy(mixed.states[i], live[i], 2), sent_.algorithm.local_proxy(
                sent_.states[i], live[i], 2)
            assert torch.equal(a, b), (t, i)
        out, other = mixed.step(live), sent_.step(live)
        assert all(torch.equal(a, b) for a, b in zip(out, other)), t
        assert all(torch.equal(a, b) for a, b in zip(mixed.anchors, sent_.anchors)), t


@pytest.mark.parametrize("topology", ["random_pairs", "complete"])
def test_the_payload_is_one_tensor_of_the_models_size_and_y_prev_stays_local(topology):
    algorithm = sent(topology=topology)
    shapes = [torch.Size([2, 3]), torch.Size([4])]
    state = algorithm.init_state(torch.arange(10.0), shapes)
    assert torch.equal(state.y_prev, state.anchor) and state.y_prev.data_ptr() != state.anchor.data_ptr()
    weights = torch.linspace(-1, 1, 10)
    payload = algorithm.payload(state, weights)
    assert isinstance(payload, torch.Tensor) and payload.shape == (10,) and payload.dtype == torch.float32
    assert torch.equal(payload, torch.lerp(torch.arange(10.0), weights, algorithm.outer_lr))  # y = θ + η·g
    # an all-reduce sums into what it is given: the complete topology sends a copy, since apply needs y
    assert (payload is state.z) == (topology != "complete")
    before = payload.clone()
    peer = torch.full((10,), 3.0)
    total = payload + peer if topology != "complete" else payload.add_(peer)
    algorithm.apply(state, total, 2)
    assert torch.equal(state.y_prev, before)  # this replica's own y, not the group's


def test_through_drivers_only_y_travels():
    """Bytes per round are one float32 model copy per peer, as in the "mixed" form."""
    n, H, rounds = 4, 3, 3
    for form in ("mixed", "sent"):
        network, replicas = replicas_for(lambda f=form: GASLoC(topology="ring", momentum_on=f), n, H)
        threaded(replicas, rounds * H)
        numel = replicas[0].flats[0].numel
        for r in replicas:
            assert [x.bytes_sent for x in r.driver.reports] == [4 * numel * len(x.peers) for x in r.driver.reports]
            assert r.driver.transport.stats.bytes_sent == 4 * numel * rounds  # one peer every ring round


def saved(state) -> dict:
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_resumes_bitwise():
    n, size, shapes = 4, 6, [torch.Size([2, 3])]
    make = functools.partial(sent, outer_lr=ETA, outer_momentum=GAMMA, gossip_step=ALPHA, seed=3)
    start = random_start(n, size, seed=8)
    g = torch.Generator().manual_seed(9)
    phases = [0.1 * torch.randn(n, size, generator=g) for _ in range(6)]
    whole = ReplicaSimulator(make(), list(start), shapes)
    out = list(start)
    for t in range(6):
        out = whole.step([w + p for w, p in zip(out, phases[t])])
    first = ReplicaSimulator(make(), list(start), shapes)
    resumed_out = list(start)
    for t in range(3):
        resumed_out = first.step([w + p for w, p in zip(resumed_out, phases[t])])
    checkpoint = [saved(s) for s in first.states]
    assert all("y_prev" in c and c["y_prev"].dtype == torch.float32 for c in checkpoint)
    second = ReplicaSimulator(make(), [torch.zeros(size)] * n, shapes)
    for s, c in zip(second.states, checkpoint):
        s.load_state_dict(c)
    second.outer_step = 3
    for t in range(3, 6):
        resumed_out = second.step([w + p for w, p in zip(resumed_out, phases[t])])
    assert all(torch.equal(a, b) for a, b in zip(resumed_out, out))
    assert all(torch.equal(a.y_prev, b.y_prev) for a, b in zip(second.states, whole.states))


def test_a_round_in_flight_resumes_bitwise():
    algorithm = sent(outer_momentum=GAMMA)
    sim = ReplicaSimulator(algorithm, list(random_start(4, 6, seed=10)))
    g = torch.Generator().manual_seed(11)
    out = list(sim.anchors)
    for _ in range(3):
        out = sim.step(inner_phases(out, g))
    state = sim.states[0]
    z = algorithm.payload(state, out[0] + 0.1)
    checkpoint = saved(state)
    assert torch.equal(checkpoint["z"], z) and torch.equal(checkpoint["y_prev"], state.y_prev)
    fresh = algorithm.init_state(torch.zeros(6), [torch.Size([6])])
    fresh.load_state_dict(checkpoint)
    total = z + torch.ones(6)
    assert torch.equal(algorithm.apply(fresh, total.clone(), 2), algorithm.apply(state, total.clone(), 2))
    assert torch.equal(fresh.y_prev, state.y_prev)


def test_a_state_of_the_other_form_is_refused_and_nothing_changes():
    weights, shapes = torch.arange(4.0), [torch.Size([4])]
    mixed_state = GASLoC().init_state(weights, shapes)
    sent_state = sent().init_state(weights + 1, shapes)
    assert "y_prev" not in mixed_state.state_dict()
    with pytest.raises(ValueError, match="saved with momentum_on='sent'.*cannot resume with momentum_on='mixed'"):
        mixed_state.load_state_dict(sent_state.state_dict())
    assert torch.equal(mixed_state.anchor, weights)
    with pytest.raises(ValueError, match="saved with momentum_on='mixed'.*cannot resume with momentum_on='sent'"):
        sent_state.load_state_dict(mixed_state.state_dict())
    assert torch.equal(sent_state.anchor, weights + 1) and torch.equal(sent_state.y_prev, weights + 1)


def test_final_weights_are_the_mix_without_the_momentum():
    n = 6
    algorithm = sent(outer_lr=ETA, outer_momentum=GAMMA, gossip_step=ALPHA)
    start = random_start(n, 5, seed=12)
    sim, ref = ReplicaSimulator(algorithm, list(start)), SentForm(algorithm, start)
    g = torch.Generator().manual_seed(13)
    out = list(start)
    for t in range(3):
        live = inner_phases(out, g)
        out = sim.step(live)
        ref.step(torch.stack(live), t)
    live = inner_phases(out, g)
    expected = ref.mix(torch.stack(live), 3)
    payloads = [algorithm.payload(s, w) for s, w in zip(sim.states, live)]
    for group in algorithm.schedule(3, n).groups:
        total = sum(payloads[j] for j in group)
        for i in group:
            before = copy.deepcopy(sim.states[i].state_dict())
            final = algorithm.final_weights(sim.states[i], total, len(group))
            assert torch.allclose(final.double(), expected[i], atol=ATOL)
            after = sim.states[i].state_dict()
            assert all(torch.equal(before[k], after[k]) for k in ("anchor", "z", "y_prev"))


# ---------------------------------------------------------------------------- through the driver


def closed_form_of_rounds(algorithm: GASLoC, replicas: list[Replica], tau: int, merge: str) -> int:
    """Each round's anchors against the closed form fed with the snapshots the drivers started from;
    the prediction (φ̂) and the live weights after the landing (τ = 0: the new anchor)."""
    ref = SentForm(algorithm, torch.stack([r.initial[0] for r in replicas]))
    rounds = len(replicas[0].logs[0].landings)
    for t in range(rounds):
        snapshots = torch.stack([r.logs[0].starts[t] for r in replicas])
        proxies = ref.proxy(snapshots)
        anchors = ref.step(snapshots, t)
        for i, r in enumerate(replicas):
            log = r.logs[0]
            landing = log.landings[t]
            assert torch.allclose(landing.anchor.double(), anchors[i], atol=ATOL), (t, i)
            if tau == 0:
                assert torch.allclose(landing.after.double(), anchors[i], atol=ATOL), (t, i)
            elif merge == "predict_correct":
                assert torch.allclose(log.after_start[t].double(), proxies[i], atol=ATOL), (t, i)
                expected = landing.before.double() + anchors[i] - proxies[i]
                assert torch.allclose(landing.after.double(), expected, atol=ATOL), (t, i)
            else:
                assert torch.equal(log.after_start[t], log.starts[t])
                expected = anchors[i] + landing.before.double() - snapshots[i]
                assert torch.allclose(landing.after.double(), expected, atol=ATOL), (t, i)
    return rounds


def alpha_for(topology: str) -> dict[str, float]:
    """α where the topology mixes with it (the complete topology averages exactly: no α to set)."""
    return {} if topology == "complete" else {"gossip_step": ALPHA}


@pytest.mark.parametrize("topology,n", [("random_pairs", 4), ("ring", 5), ("complete", 4)])
def test_replicas_on_the_in_process_network_follow_the_closed_form(topology, n):
    make = functools.partial(sent, outer_lr=ETA, outer_momentum=GAMMA, topology=topology, **alpha_for(topology))
    H, rounds = 3, 4
    _, replicas = replicas_for(make, n, H)
    threaded(replicas, rounds * H)  # synchronous rounds block until the group's peers post
    assert closed_form_of_rounds(make(), replicas, 0, "none") == rounds
    assert check_rounds(make, replicas, 0) == rounds  # and bitwise the simulator's (the strategies' code)


@pytest.mark.parametrize("merge", ["predict_correct", "delayed"])
@pytest.mark.parametrize("topology,n", [("random_pairs", 4), ("ring", 5), ("complete", 4)])
def test_overlapped_rounds_follow_the_closed_form_on_the_snapshots(topology, n, merge):
    make = functools.partial(sent, outer_lr=ETA, outer_momentum=GAMMA, topology=topology, **alpha_for(topology))
    H, tau, rounds = 4, 2, 3
    _, replicas = replicas_for(make, n, H, overlap_steps=tau, overlap_merge=merge)
    lockstep(replicas, rounds * H + tau)  # an overlapped round never blocks before its landing
    assert closed_form_of_rounds(make(), replicas, tau, merge) == rounds
    assert check_rounds(make, replicas, tau, merge) == rounds


class Drifting:
    """A replica whose inner steps move it by a fixed amount, whatever its weights: the case where an
    overlapped run equals the synchronous one."""

    def __init__(self, i: int, network: InProcessNetwork, algorithm: GASLoC, sync_every: int, **kwargs) -> None:
        self.param = torch.nn.Parameter(random_start(1, 5, seed=14)[0].clone())
        self.drift = torch.randn(5, generator=torch.Generator().manual_seed(100 + i))
        self.driver = OuterStepDriver.of(algorithm, network.transport(i), sync_every, **kwargs)
        self.driver.add(FlatParameters([self.param], CPU))

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def step(self) -> None:
        s = self.driver.slots[0].inner_steps
        with torch.no_grad():
            self.param.add_(self.drift, alpha=0.05 * (1 + s % 3))
        self.driver.after_inner_step(0)


@pytest.mark.parametrize("merge", ["predict_correct", "delayed"])
def test_overlap_equals_the_synchronous_run_only_when_inner_steps_ignore_the_weights(merge):
    """Landing at s + τ, θ = φ⁺ + (what the τ steps did) with either merge. When the inner steps move the
    weights by amounts that do not depend on them, that is what the synchronous run has at s + τ, and
    the next snapshots agree too; when they do depend on them (a pull towards a target), it is not."""
    n, H, tau, rounds = 4, 4, 2, 3
    make = functools.partial(sent, outer_lr=ETA, outer_momentum=GAMMA, gossip_step=ALPHA)
    network = InProcessNetwork(n, timeout=10.0)
    synchronous = [Drifting(i, network, make(), H) for i in range(n)]
    run_in_threads([functools.partial(r.run, rounds * H + tau) for r in synchronous])
    network = InProcessNetwork(n, timeout=10.0)
    overlapped = [Drifting(i, network, make(), H, overlap_steps=tau, overlap_merge=merge) for i in range(n)]
    for _ in range(rounds * H + tau):
        for r in overlapped:
            r.step()
    for a, b in zip(synchronous, overlapped):
        assert len(b.driver.reports) == rounds and b.driver.reports[-1].overlap_steps == tau
        assert torch.allclose(a.param.detach(), b.param.detach(), atol=ATOL)
        assert torch.allclose(a.driver.slots[0].state.anchor, b.driver.slots[0].state.anchor, atol=ATOL)
        assert torch.allclose(a.driver.slots[0].state.y_prev, b.driver.slots[0].state.y_prev, atol=ATOL)
    _, pulled_sync = replicas_for(make, n, H)
    threaded(pulled_sync, rounds * H + tau)
    _, pulled = replicas_for(make, n, H, overlap_steps=tau, overlap_merge=merge)
    lockstep(pulled, rounds * H + tau)
    gap = max((a.flats[0].gather() - b.flats[0].gather()).abs().max().item() for a, b in zip(pulled_sync, pulled))
    assert gap > 1e-3


def test_the_end_of_training_lands_on_the_mix():
    """final_outer_step="average": a round landed by ``land_all`` sets the live weights to x (no
    momentum); the outer step's own live weights are kept for training that goes on."""
    n, H, tau, rounds = 4, 4, 1, 2
    make = functools.partial(sent, outer_lr=ETA, outer_momentum=GAMMA, gossip_step=ALPHA)
    _, replicas = replicas_for(make, n, H, overlap_steps=tau)
    lockstep(replicas, rounds * H)  # the last round is in flight
    ref = SentForm(make(), torch.stack([r.initial[0] for r in replicas]))
    for t in range(rounds - 1):
        ref.step(torch.stack([r.logs[0].starts[t] for r in replicas]), t)
    snapshots = torch.stack([r.logs[0].starts[rounds - 1] for r in replicas])
    mix = ref.mix(snapshots, rounds - 1)
    anchors = ref.step(snapshots, rounds - 1)
    for i, r in enumerate(replicas):
        r.driver.land_all()
        slot = r.driver.slots[0]
        assert r.driver.reports[-1].final
        assert torch.allclose(slot.flat.gather().double(), mix[i], atol=ATOL)  # no steps since the start
        assert torch.allclose(slot.outer_weights.double(), anchors[i], atol=ATOL)
        assert torch.allclose(slot.state.anchor.double(), anchors[i], atol=ATOL)


# ---------------------------------------------------------------------------- elastic


def test_elastic_rounds_equal_the_static_drivers_bitwise():
    n, rounds, ids = 3, 4, ("a", "b", "c")
    script = [Script(quorum_id=1, switch=0, members=ids)]
    hub = Hub()
    elastic = [elastic_runner(hub, r, i, script, sent(outer_momentum=GAMMA)) for i, r in enumerate(ids)]
    network = InProcessNetwork(n)
    static = [Runner(i, network.transport(i), algorithm=sent(outer_momentum=GAMMA)) for i in range(n)]
    in_threads(*[lambda r=r: r.run(rounds * ELASTIC_H) for r in elastic])
    in_threads(*[lambda r=r: r.run(rounds * ELASTIC_H) for r in static])
    for e, s in zip(elastic, static):
        assert torch.equal(e.param.detach(), s.param.detach())
        assert torch.equal(e.driver.slots[0].state.y_prev, s.driver.slots[0].state.y_prev)


def test_an_elastic_round_taken_alone_is_the_step_of_a_group_of_one():
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a, b = (elastic_runner(hub, r, i, script, sent(outer_momentum=GAMMA)) for i, r in enumerate("ab"))
    in_threads(lambda: a.run(ELASTIC_H), lambda: b.run(ELASTIC_H))
    hub.kill("b")
    a.run(ELASTIC_H - 1)
    a.inner_step()
    slot, algorithm = a.driver.slots[0], a.driver.algorithm
    y_prev, anchor, weights = slot.state.y_prev.clone(), slot.state.anchor.double(), slot.flat.gather()
    y = anchor + algorithm.outer_lr * (weights.double() - anchor)
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.driver.after_inner_step(0)
    assert torch.allclose(a.param.detach().double(), y + GAMMA * (y - y_prev.double()), atol=ATOL)  # x = y alone


class Donor(ElasticPlugin):
    """Hands a joiner a copy of its state, taken at the switch (the real membership sends it over the
    wire then; the in-process hub would pass the live tensors on), and keeps one more to compare."""

    def export_state(self):
        state = copy.deepcopy(super().export_state())
        self.copies = getattr(self, "copies", []) + [copy.deepcopy(state)]
        return state


def test_a_joiner_heals_with_the_donors_previous_sent_iterate():
    hub = Hub()
    script = [Script(1, 0, ("a", "b")), Script(2, 2, ("a", "b", "c"), joiners=("c",), donor="a")]

    def runner(replica_id: str, index: int, plugin=ElasticPlugin) -> Runner:
        transport = ElasticTransport(ElasticConfig(lighthouse="127.0.0.1:1", replica_id=replica_id),
                                     membership=FakeMembership(hub, replica_id, script))
        return Runner(index, transport, plugin(transport), sent(outer_momentum=GAMMA))

    a, b = runner("a", 0, Donor), runner("b", 1)
    healed: dict = {}

    def joiner() -> None:
        c = runner("c", 2)  # before_training waits for a's state, sent at the switch before round 2
        healed["state"] = copy.deepcopy(c.driver.slots[0].state.state_dict())
        c.run(3 * ELASTIC_H)

    in_threads(lambda: a.run(5 * ELASTIC_H), lambda: b.run(5 * ELASTIC_H), joiner)
    (given,) = a.driver.plugin.copies
    donated = given["driver"][0]["state"]
    assert torch.equal(healed["state"]["y_prev"], donated["y_prev"])
    assert not torch.equal(donated["y_prev"], donated["anchor"])  # a real previous iterate, not θ_0


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("value", ["heavy_ball", "Sent", None, 1])
def test_an_unknown_form_is_refused_naming_the_allowed_values(value):
    for build in (GASLoC, GASLoCStrategy):
        with pytest.raises(ValueError, match=r"momentum_on must be 'mixed' .* or 'sent' .*got"):
            build(momentum_on=value)


def test_the_sent_form_refuses_a_custom_outer_optimizer_and_still_checks_gamma():
    from lightning_loco.rules import build_options

    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    for build in (lambda **kwargs: build_options(GASLoC(**kwargs), 10), GASLoCStrategy):
        with pytest.raises(ValueError, match="outer_optimizer with momentum_on='sent'.*momentum_on='mixed'"):
            build(momentum_on="sent", outer_optimizer=adam)
        with pytest.raises(ValueError, match="outer_momentum"):
            build(momentum_on="sent", outer_momentum=1.0)


def test_the_strategy_takes_the_form_and_keeps_the_default():
    assert GASLoCStrategy().algorithm.momentum_on == "mixed"
    strategy = GASLoCStrategy(momentum_on="sent", outer_momentum=0.4, topology="ring")
    assert (strategy.algorithm.momentum_on, strategy.algorithm.outer_momentum) == ("sent", 0.4)


def test_the_stability_warning_follows_the_form():
    """Heavy ball on the sent iterates diverged on random pairs at γ = 0.9 with α = ¼, where the "mixed"
    form stays stable (benchmarks/gasloc_consensus.py --forms)."""
    import warnings

    with pytest.warns(UserWarning, match=r"momentum_on='sent'.*exceeds the largest γ \(0.8\)"):
        GASLoCStrategy(momentum_on="sent", outer_momentum=0.9)
    with pytest.warns(UserWarning, match=r"exceeds the largest γ \(0.6\)"):
        GASLoCStrategy(momentum_on="sent", topology="exponential", outer_momentum=0.7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GASLoCStrategy(outer_momentum=0.9)  # the "mixed" form stayed stable there
        GASLoCStrategy(momentum_on="sent")  # the defaults are inside
        GASLoCStrategy(momentum_on="sent", topology="ring", outer_momentum=0.95)
        GASLoCStrategy(momentum_on="sent", topology="complete", outer_momentum=0.95)
