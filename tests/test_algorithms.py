"""The outer-step maths against hand computations and the identities of the spec (no processes)."""

import functools
import math

import pytest
import torch

from lightning_loco.algorithms import DiLoCo, NoLoCo

from oracle import ReplicaSimulator


def inner_phase(anchors, scale=0.1, seed=0):
    """Stand-in for H inner steps: each replica moves from its live weights by its own amount."""
    g = torch.Generator().manual_seed(seed)
    return [a + scale * torch.randn(a.shape, generator=g) for a in anchors]


def test_noloco_pair_update_by_hand():
    # Two replicas (the pairing is forced). α = 0.5, β = 0.7, γ = 0.3 (γ ≠ β: anchors travel too).
    alg = NoLoCo(outer_lr=0.7, outer_momentum=0.5, averaging_rate=0.3)
    sim = ReplicaSimulator(alg, [torch.tensor([1.0]), torch.tensor([3.0])])
    # Round 1: θ0 = 2, θ1 = 3.5. Δ̄ = mean(2-1, 3.5-3) = 0.75, φ̄ = 2.
    # δ0 = 0.7·0.75 − 0.3·(1 − 2) = 0.825 → φ0 = 1.825
    # δ1 = 0.7·0.75 − 0.3·(3 − 2) = 0.225 → φ1 = 3.225
    new = sim.step([torch.tensor([2.0]), torch.tensor([3.5])])
    assert new[0].item() == pytest.approx(1.825) and new[1].item() == pytest.approx(3.225)
    # Round 2: θ0 = 2.0, θ1 = 3.0. Δ̄ = mean(0.175, −0.225) = −0.025, φ̄ = 2.525.
    # δ0 = 0.5·0.825 + 0.7·(−0.025) − 0.3·(1.825 − 2.525) = 0.4125 − 0.0175 + 0.21 = 0.605 → 2.43
    # δ1 = 0.5·0.225 + 0.7·(−0.025) − 0.3·(3.225 − 2.525) = 0.1125 − 0.0175 − 0.21 = −0.115 → 3.11
    new = sim.step([torch.tensor([2.0]), torch.tensor([3.0])])
    assert new[0].item() == pytest.approx(2.43) and new[1].item() == pytest.approx(3.11)


def test_noloco_sign_follows_inner_progress():
    # The corrected sign: with every replica moving the same way, the anchor moves that way too.
    alg = NoLoCo()
    sim = ReplicaSimulator(alg, [torch.zeros(3)] * 4)
    new = sim.step([torch.ones(3)] * 4)
    assert torch.allclose(new[0], torch.full((3,), 0.7))


def explicit_noloco(anchors, momenta, thetas, groups, alpha, beta, gamma):
    """The spec's general formula written out in float64, independently of the library."""
    new_anchors, new_momenta = list(anchors), list(momenta)
    for g in groups:
        d_bar = sum(thetas[j].double() - anchors[j].double() for j in g) / len(g)
        phi_bar = sum(anchors[j].double() for j in g) / len(g)
        for i in g:
            delta = alpha * momenta[i].double() + beta * d_bar - gamma * (anchors[i].double() - phi_bar)
            new_momenta[i] = delta
            new_anchors[i] = anchors[i].double() + delta
    return new_anchors, new_momenta


@pytest.mark.parametrize("gamma", [None, 0.9])
@pytest.mark.parametrize("n,group_size", [(2, 2), (5, 2), (7, 3), (8, 2)])
def test_noloco_matches_the_explicit_formula(n, group_size, gamma):
    alg = NoLoCo(outer_lr=0.7, outer_momentum=0.5, averaging_rate=gamma, group_size=group_size, seed=11)
    start = torch.randn(10, generator=torch.Generator().manual_seed(1))
    sim = ReplicaSimulator(alg, [start] * n)
    anchors = [start.double()] * n
    momenta = [torch.zeros(10, dtype=torch.float64)] * n
    live = [start] * n
    for t in range(6):
        thetas = inner_phase(live, seed=t)
        groups = alg.schedule(t, n).groups
        anchors, momenta = explicit_noloco(anchors, momenta, thetas, groups, 0.5, 0.7, alg.averaging_rate)
        live = sim.step(thetas)
        for i in range(n):
            assert torch.allclose(live[i].double(), anchors[i], atol=1e-5)
            assert torch.allclose(sim.states[i].momentum.double(), momenta[i], atol=1e-5)


def test_noloco_weights_only_form_equals_general_form():
    # γ = β lets only θ travel; the general form (θ and φ travel) must give the same update.
    start = torch.randn(20, generator=torch.Generator().manual_seed(2))
    fast = ReplicaSimulator(NoLoCo(averaging_rate=None), [start] * 6)
    general = ReplicaSimulator(NoLoCo(averaging_rate=0.7 * (1 + 1e-12)), [start] * 6)
    assert fast.algorithm.sends_weights_only and not general.algorithm.sends_weights_only
    a = b = [start] * 6
    for t in range(5):
        a = fast.step(inner_phase(a, seed=t))
        b = general.step(inner_phase(b, seed=t))
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-5)


def heavy_ball(mean_anchor, momentum, mean_pseudo_gradient, alpha, beta):
    momentum = alpha * momentum + beta * mean_pseudo_gradient
    return mean_anchor + momentum, momentum


@pytest.mark.parametrize("n,group_size", [(4, 2), (7, 2), (9, 3), (10, 4)])
def test_noloco_mean_over_replicas_follows_heavy_ball_diloco(n, group_size):
    alg = NoLoCo(outer_lr=0.7, outer_momentum=0.5, group_size=group_size, seed=4)
    start = torch.randn(16, generator=torch.Generator().manual_seed(3)).double()
    sim = ReplicaSimulator(alg, [start.float()] * n)
    mean, m = start, torch.zeros_like(start)
    live = [start.float()] * n
    for t in range(8):
        thetas = inner_phase(live, seed=10 + t)
        d = sum(th.double() - s.anchor.double() for th, s in zip(thetas, sim.states)) / n
        mean, m = heavy_ball(mean, m, d, 0.5, 0.7)
        live = sim.step(thetas)
        got = sum(a.double() for a in sim.anchors) / n
        assert torch.allclose(got, mean, atol=1e-5)
    assert not all(torch.equal(live[0], x) for x in live[1:])  # the replicas themselves differ


def test_noloco_one_group_of_all_equals_heavy_ball_diloco():
    n = 5
    start = torch.randn(12, generator=torch.Generator().manual_seed(5))
    noloco = ReplicaSimulator(NoLoCo(outer_lr=0.7, outer_momentum=0.5, group_size=n), [start] * n)
    sgd = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.5)  # heavy ball, not Nesterov
    diloco = ReplicaSimulator(DiLoCo(outer_optimizer=sgd), [start] * n)
    a = b = [start] * n
    for t in range(6):
        thetas = inner_phase(a, seed=t)
        a = noloco.step(thetas)
        b = diloco.step(thetas)
        for x in a[1:]:
            assert torch.equal(x, a[0])  # all replicas stay bitwise identical
        assert torch.allclose(a[0], b[0], atol=1e-6)


def test_single_replica_noloco_is_heavy_ball_on_its_own_progress():
    alg = NoLoCo(outer_lr=0.7, outer_momentum=0.5)
    sim = ReplicaSimulator(alg, [torch.zeros(2)])
    phi, m = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    live = [torch.zeros(2)]
    for t in range(4):
        theta = inner_phase(live, seed=t)
        phi, m = heavy_ball(phi, m, theta[0].double() - phi, 0.5, 0.7)
        live = sim.step(theta)
        assert torch.allclose(live[0].double(), phi, atol=1e-6)


def test_diloco_with_outer_lr_one_and_no_momentum_is_model_averaging():
    n = 4
    start = torch.randn(8, generator=torch.Generator().manual_seed(6))
    sim = ReplicaSimulator(DiLoCo(outer_lr=1.0, outer_momentum=0.0), [start] * n)
    live = [start] * n
    for t in range(3):
        thetas = inner_phase(live, seed=t)
        live = sim.step(thetas)
        average = sum(thetas) / n
        for x in live:
            assert torch.allclose(x, average, atol=1e-6)


def test_diloco_default_is_nesterov_sgd_by_hand():
    # One coordinate, two replicas. lr 0.7, momentum 0.9, Nesterov.
    sim = ReplicaSimulator(DiLoCo(), [torch.tensor([0.0])] * 2)
    # Round 1: mean θ = 1 → g = −1; buf = −1; step = g + 0.9·buf = −1.9; φ = 0 + 0.7·1.9 = 1.33
    new = sim.step([torch.tensor([0.5]), torch.tensor([1.5])])
    assert new[0].item() == pytest.approx(1.33)
    # Round 2: θ = φ + 1 on average → g = −1; buf = 0.9·(−1) − 1 = −1.9; step = −1 + 0.9·(−1.9) = −2.71
    new = sim.step([torch.tensor([2.33]), torch.tensor([2.33])])
    assert new[0].item() == pytest.approx(1.33 + 0.7 * 2.71)


def test_diloco_heavy_ball_is_the_noloco_authors_baseline_by_hand():
    """The NoLoCo authors' DiLoCo baseline (gensyn-ai/noloco, pipeline_diloco_optimizer.py) steps
    m ← μ·m − lr·g, φ ← φ + m with g = φ − mean θ: heavy ball. DiLoCo(nesterov=False) is that update."""
    lr, mu = 0.7, 0.3
    sim = ReplicaSimulator(DiLoCo(outer_lr=lr, outer_momentum=mu, nesterov=False), [torch.tensor([0.0])] * 2)
    phi, m = 0.0, 0.0
    for deltas in ((0.5, 1.5), (2.0, -1.0), (0.25, 0.75)):
        new = sim.step([torch.tensor([phi + d]) for d in deltas])
        g = phi - (phi + sum(deltas) / 2)
        m = mu * m - lr * g
        phi = phi + m
        assert new[0].item() == pytest.approx(phi) and new[1].item() == pytest.approx(phi)


def test_diloco_accepts_any_outer_optimizer_with_per_parameter_shapes():
    shapes = [torch.Size([2, 3]), torch.Size([4])]
    adam = functools.partial(torch.optim.Adam, lr=0.1)
    sim = ReplicaSimulator(DiLoCo(outer_optimizer=adam), [torch.zeros(10)] * 3, shapes=shapes)
    opt = sim.states[0].optimizer
    assert isinstance(opt, torch.optim.Adam)
    assert [p.shape for g in opt.param_groups for p in g["params"]] == shapes
    new = sim.step([torch.ones(10)] * 3)
    assert torch.allclose(new[0], torch.full((10,), 0.1), atol=1e-6)  # Adam's first step is lr·sign


def test_outer_state_round_trips_through_state_dict():
    for alg in (NoLoCo(), DiLoCo()):
        sim = ReplicaSimulator(alg, [torch.zeros(5)] * 2)
        sim.step([torch.ones(5), 2 * torch.ones(5)])
        saved = sim.states[0].state_dict()
        other = alg.init_state(torch.zeros(5), [torch.Size([5])])
        other.load_state_dict(saved)
        assert torch.equal(other.anchor, sim.states[0].anchor)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_lr": -1.0}, "outer_lr"),
        ({"outer_lr": math.nan}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_momentum": -0.1}, "outer_momentum"),
        ({"averaging_rate": -0.5}, "averaging_rate"),
        ({"group_size": 1}, "group_size"),
        ({"group_size": 2.5}, "group_size"),
    ],
)
def test_noloco_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NoLoCo(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.5}, "outer_momentum"),
        ({"outer_optimizer": "sgd"}, "callable"),
    ],
)
def test_diloco_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCo(**kwargs)


def test_diloco_rejects_a_factory_that_returns_no_optimizer():
    with pytest.raises(ValueError, match="Optimizer"):
        DiLoCo(outer_optimizer=lambda params: None).init_state(torch.zeros(2), [torch.Size([2])])
