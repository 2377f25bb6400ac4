"""GASLoC: schedules, maths identities and consensus acceleration (no processes)."""

import functools

import lightning as L
import pytest
import torch

from lightning_loco import GASLoCStrategy
from lightning_loco.algorithms import DiLoCo, GASLoC
from lightning_loco.algorithms.schedules import exponential_matching, random_matching, ring_matching

from oracle import ReplicaSimulator


def schedules(n):
    out = {"random_pairs": lambda t: random_matching(n, 7, t), "ring": lambda t: ring_matching(n, t)}
    if n & (n - 1) == 0:
        out["exponential"] = lambda t: exponential_matching(n, t)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16])
def test_every_topology_gives_a_matching_identical_on_every_rank(n):
    for name, schedule in schedules(n).items():
        for t in range(12):
            r = schedule(t)
            members = [i for g in r.groups for i in g]
            assert sorted(members) == list(range(n)), (name, t, r.groups)  # nobody twice, nobody missing
            assert all(len(g) in (1, 2) and len(set(g)) == len(g) for g in r.groups)  # pairs, no self-pairs
            assert sum(len(g) == 1 for g in r.groups) == n % 2  # odd N: exactly one sits out
            assert schedule(t) == r  # recomputed independently: the same on every rank
            assert not r.collective


def test_ring_alternates_even_and_odd_edges():
    assert ring_matching(6, 0).groups == ((0, 1), (2, 3), (4, 5))
    assert ring_matching(6, 1).groups == ((1, 2), (3, 4), (0, 5))
    assert ring_matching(5, 1).groups == ((1, 2), (3, 4), (0,))


def test_exponential_pairs_i_with_i_xor_power_of_two():
    for t in range(6):
        bit = 1 << (t % 3)
        assert all(g == tuple(sorted((g[0], g[0] ^ bit))) for g in exponential_matching(8, t).groups)
    with pytest.raises(ValueError, match="power-of-two"):
        exponential_matching(6, 0)


def test_random_matching_changes_with_outer_step():
    assert len({random_matching(8, 0, t).groups for t in range(10)}) > 5


def inner_phase(live, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return [w + scale * torch.randn(w.shape, generator=g) for w in live]


def test_pair_average_special_case():
    # γ = 0, η = 1, α = ½: H local steps, then average with one random peer (gossip local SGD).
    n = 7
    alg = GASLoC(outer_lr=1.0, outer_momentum=0.0, gossip_step=0.5, seed=3)
    start = torch.randn(6, generator=torch.Generator().manual_seed(0))
    sim = ReplicaSimulator(alg, [start] * n)
    live = [start] * n
    for t in range(4):
        thetas = inner_phase(live, seed=t)
        live = sim.step(thetas)
        for group in sim.last_round.groups:
            mean = sum(thetas[j] for j in group) / len(group)
            for i in group:
                assert torch.allclose(live[i], mean, atol=1e-6)


def explicit_gasloc(anchors, x_prev, thetas, groups, eta, gamma, alpha):
    """The spec's update in its explicit form, float64."""
    z = [a + eta * (th.double() - a) for a, th in zip(anchors, thetas)]
    new_anchors, new_prev = list(anchors), list(x_prev)
    for g in groups:
        for i in g:
            x = z[i] - alpha * sum(z[i] - z[j] for j in g if j != i)
            new_anchors[i] = x + gamma * (x - x_prev[i])
            new_prev[i] = x
    return new_anchors, new_prev


@pytest.mark.parametrize("topology,n", [("random_pairs", 6), ("random_pairs", 7), ("ring", 5), ("exponential", 8)])
def test_sgd_form_equals_the_explicit_extrapolation(topology, n):
    alg = GASLoC(outer_lr=0.8, outer_momentum=0.6, gossip_step=0.3, topology=topology, seed=1)
    start = torch.randn(9, generator=torch.Generator().manual_seed(1))
    sim = ReplicaSimulator(alg, [start] * n)
    anchors = [start.double()] * n
    x_prev = [start.double()] * n
    live = [start] * n
    for t in range(8):
        thetas = inner_phase(live, seed=20 + t)
        anchors, x_prev = explicit_gasloc(anchors, x_prev, thetas, alg.schedule(t, n).groups, 0.8, 0.6, 0.3)
        live = sim.step(thetas)
        for i in range(n):
            assert torch.allclose(live[i].double(), anchors[i], atol=1e-5), (t, i)


@pytest.mark.parametrize("topology,n", [("random_pairs", 8), ("random_pairs", 7), ("ring", 6), ("exponential", 4)])
def test_mean_over_replicas_follows_nesterov_diloco_on_the_mean_pseudo_gradient(topology, n):
    eta, gamma = 0.7, 0.8
    alg = GASLoC(outer_lr=eta, outer_momentum=gamma, gossip_step=0.25, topology=topology, seed=2)
    start = torch.randn(12, generator=torch.Generator().manual_seed(2))
    sim = ReplicaSimulator(alg, [start] * n)
    mean, buf = start.double(), None
    live = [start] * n
    for t in range(8):
        thetas = inner_phase(live, seed=40 + t)
        g = -eta * sum(th.double() - s.anchor.double() for th, s in zip(thetas, sim.states)) / n  # d = θ − x
        buf = g if buf is None else gamma * buf + g
        mean = mean - (g + gamma * buf)  # Nesterov SGD, lr 1
        live = sim.step(thetas)
        assert torch.allclose(sum(a.double() for a in sim.anchors) / n, mean, atol=1e-5)
    assert not all(torch.equal(live[0], w) for w in live[1:])


def test_complete_topology_equals_diloco_with_the_same_outer_sgd():
    n, eta, gamma = 5, 0.7, 0.9
    start = torch.randn(10, generator=torch.Generator().manual_seed(4))
    gasloc = ReplicaSimulator(GASLoC(outer_lr=eta, outer_momentum=gamma, topology="complete"), [start] * n)
    diloco = ReplicaSimulator(DiLoCo(outer_lr=eta, outer_momentum=gamma, nesterov=True), [start] * n)
    a = b = [start] * n
    for t in range(6):
        thetas = inner_phase(a, seed=t)
        a, b = gasloc.step(thetas), diloco.step(thetas)
        assert torch.allclose(a[0], b[0], atol=1e-5)
        assert all(torch.equal(a[0], w) for w in a[1:])


def test_only_z_travels_one_model_copy():
    alg = GASLoC()
    state = alg.init_state(torch.zeros(5), [torch.Size([5])])
    assert alg.payload(state, torch.ones(5)).numel() == 5


def test_an_adaptive_outer_optimizer_steps_the_anchor_with_d():
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    sim = ReplicaSimulator(GASLoC(outer_optimizer=adam, topology="ring"), [torch.zeros(4)] * 2)
    assert isinstance(sim.states[0].optimizer, torch.optim.Adam)
    new = sim.step([torch.ones(4), torch.ones(4)])
    assert torch.allclose(new[0], torch.full((4,), 0.01), atol=1e-6)  # Adam's first step: lr·sign(−d)


def rounds_to_consensus(n, alpha, gamma, topology="ring", max_rounds=2000):
    g = torch.Generator().manual_seed(0)
    live = [torch.randn(4, generator=g) for _ in range(n)]
    sim = ReplicaSimulator(GASLoC(outer_momentum=gamma, gossip_step=alpha, topology=topology), live)

    def spread(ws):
        s = torch.stack(ws)
        return (s - s.mean(0)).pow(2).sum(1).mean().sqrt().item()

    start = spread(live)
    for r in range(1, max_rounds + 1):
        live = sim.step(live)  # no inner progress: pure consensus
        if spread(live) < 1e-3 * start:
            return r
    return max_rounds + 1


def test_outer_momentum_accelerates_consensus_on_a_ring():
    plain = rounds_to_consensus(16, alpha=0.25, gamma=0.0)
    tuned = min(rounds_to_consensus(16, alpha=0.25, gamma=g) for g in (0.7, 0.8))
    assert plain <= 2000
    assert tuned * 3 <= plain, (plain, tuned)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"gossip_step": 0.0}, "gossip_step"),
        ({"gossip_step": 1.5}, "gossip_step"),
        ({"topology": "star"}, "topology"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_optimizer": 3}, "callable"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GASLoC(**kwargs)
    with pytest.raises(ValueError, match=match):
        GASLoCStrategy(**kwargs)


def test_exponential_with_a_non_power_of_two_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="power-of-two"):
        L.Trainer(strategy=GASLoCStrategy(topology="exponential"), accelerator="cpu", devices=3, logger=False)
    trainer = L.Trainer(strategy=GASLoCStrategy(topology="exponential"), accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy.num_processes == 4


def test_registered_name():
    trainer = L.Trainer(strategy="gasloc", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is GASLoCStrategy


def test_momentum_outside_the_simulated_stable_range_warns():
    import warnings

    with pytest.warns(UserWarning, match="stable"):
        GASLoCStrategy(gossip_step=0.5, outer_momentum=0.8)  # diverged on random pairs at N >= 64
    with pytest.warns(UserWarning, match="simulated"):
        GASLoCStrategy(gossip_step=0.9, outer_momentum=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GASLoCStrategy()  # the defaults are inside
        GASLoCStrategy(topology="complete", outer_momentum=0.9)
        GASLoCStrategy(topology="ring", gossip_step=0.25, outer_momentum=0.9)
