"""Overlap maths and bookkeeping without processes: local proxies, merges, argument checks, auto τ.

The multi-process behaviour (landing step, anchor identities, checkpoints, no blocking) is in
``test_overlap_multiprocess.py``.
"""

import copy
import functools

import pytest
import torch

import lightning_loco
from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.overlap import AutoOverlap, auto_cap, merge_at_landing
from lightning_loco.replica.options import Options

from oracle import ReplicaSimulator


def warmed_up(algorithm, n=4, rounds=2, size=6, seed=0):
    """A simulator after a few rounds, so that momenta and previous iterates are not trivial."""
    g = torch.Generator().manual_seed(seed)
    sim = ReplicaSimulator(algorithm, [torch.randn(size, generator=g)] * n, shapes=[torch.Size([2, 3])])
    live = [torch.randn(size, generator=g) for _ in range(n)]
    for _ in range(rounds):
        live = [w + 0.1 * torch.randn(size, generator=g) for w in sim.step(live)]
    return sim, live


def _tensors(tree):
    if torch.is_tensor(tree):
        yield tree.float()
    elif isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _tensors(tree[k])
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def snapshot(state):
    return copy.deepcopy(state.state_dict())


ALGORITHMS = {
    "noloco": lambda: NoLoCo(),
    "noloco_general_gamma": lambda: NoLoCo(averaging_rate=0.9),
    "diloco": lambda: DiLoCo(),
    "diloco_adam": lambda: DiLoCo(outer_optimizer=functools.partial(torch.optim.Adam, lr=0.1)),
    "gasloc": lambda: GASLoC(),
    "gasloc_complete": lambda: GASLoC(topology="complete"),
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_local_proxy_commits_nothing(name):
    sim, live = warmed_up(ALGORITHMS[name]())
    alg, state = sim.algorithm, sim.states[1]
    before = _flat(snapshot(state))
    proxies = [alg.local_proxy(state, live[1], n) for n in (1, 2, 4)]
    assert torch.equal(before, _flat(state.state_dict()))
    assert not torch.equal(proxies[0], state.anchor)
    # the proxy does not depend on the group's size: every member is this replica
    assert torch.allclose(proxies[0], proxies[1], atol=1e-6) and torch.allclose(proxies[0], proxies[2], atol=1e-6)


@pytest.mark.parametrize("gamma", [None, 0.9])
def test_noloco_closed_form_equals_the_generic_definition(gamma):
    # The definition: payload and apply on a copy of the state, with a group sum of n copies of the
    # replica's own payload. NoLoCo's closed form must agree with it.
    sim, live = warmed_up(NoLoCo(averaging_rate=gamma))
    for n in (2, 3):
        shadow = copy.deepcopy(sim.states[0])  # payload and apply on a copy, with n copies of our own payload
        generic = sim.algorithm.apply(shadow, sim.algorithm.payload(shadow, live[0].clone()) * n, n)
        assert torch.allclose(sim.algorithm.local_proxy(sim.states[0], live[0], n), generic, atol=1e-6)


def _flat(d):
    return torch.cat([t.reshape(-1) for t in _tensors(d)])


def test_noloco_proxy_by_the_spec_formula():
    sim, live = warmed_up(NoLoCo(outer_lr=0.7, outer_momentum=0.5))
    state, theta = sim.states[2], live[2]
    phi, delta = state.anchor, state.momentum
    assert delta.abs().sum() > 0
    expected = phi + 0.5 * delta + 0.7 * (theta - phi)  # φ_i + α·δ_i + β·(S_i − φ_i)
    assert torch.allclose(NoLoCo().local_proxy(state, theta, 2), expected, atol=1e-6)


def test_gasloc_proxy_by_the_spec_formula():
    # z_i + γ·(z_i − x_prev_i) with the default outer SGD(lr=1, momentum=γ, Nesterov).
    eta, gamma = 0.7, 0.5
    alg = GASLoC(outer_lr=eta, outer_momentum=gamma)
    g = torch.Generator().manual_seed(3)
    start = torch.randn(6, generator=g)
    sim = ReplicaSimulator(alg, [start] * 4, shapes=[torch.Size([6])])
    # x_prev is the previous mixed iterate: track it from the spec's formula alongside the library.
    anchors, x_prev = [start.double()] * 4, [start.double()] * 4
    live = [start + 0.1 * torch.randn(6, generator=g) for _ in range(4)]
    for t in range(2):
        z = [a + eta * (w.double() - a) for a, w in zip(anchors, live)]
        new_anchors, new_prev = list(anchors), list(x_prev)
        for grp in alg.schedule(t, 4).groups:
            for i in grp:
                x = z[i] - 0.25 * sum(z[i] - z[j] for j in grp if j != i)
                new_anchors[i], new_prev[i] = x + gamma * (x - x_prev[i]), x
        anchors, x_prev = new_anchors, new_prev
        out = sim.step(live)
        assert torch.allclose(out[0].double(), anchors[0], atol=1e-5)
        live = [w + 0.1 * torch.randn(6, generator=g) for w in out]
    i = 3
    z = anchors[i] + eta * (live[i].double() - anchors[i])
    expected = z + gamma * (z - x_prev[i])
    assert torch.allclose(alg.local_proxy(sim.states[i], live[i], 2).double(), expected, atol=1e-5)


def test_diloco_proxy_is_the_outer_step_on_the_replicas_own_pseudo_gradient():
    sim, live = warmed_up(DiLoCo(outer_lr=0.7, outer_momentum=0.9))
    state = sim.states[0]
    # the proxy of replica 0 equals a full DiLoCo step in a world where every replica sent θ_0
    twin = ReplicaSimulator(DiLoCo(outer_lr=0.7, outer_momentum=0.9), [state.anchor] * 3, shapes=[torch.Size([2, 3])])
    for s in twin.states:
        s.load_state_dict(copy.deepcopy(state.state_dict()))
    expected = twin.step([live[0]] * 3)[0]
    assert torch.allclose(sim.algorithm.local_proxy(state, live[0], 4), expected, atol=1e-6)


def test_merges_follow_the_spec():
    g = torch.Generator().manual_seed(0)
    live, new_anchor, proxy, snap = (torch.randn(5, generator=g) for _ in range(4))
    merged, correction = merge_at_landing("predict_correct", live, new_anchor, proxy)
    assert torch.allclose(merged, live + (new_anchor - proxy)) and torch.allclose(correction, new_anchor - proxy)
    merged, correction = merge_at_landing("delayed", live, new_anchor, snap)
    assert torch.allclose(merged, new_anchor + (live - snap)) and torch.allclose(correction, merged - live)
    # with no inner progress since the snapshot, a delayed merge lands exactly on the new anchor
    merged, _ = merge_at_landing("delayed", snap.clone(), new_anchor, snap)
    assert torch.equal(merged, new_anchor)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"overlap_steps": 10}, "smaller than sync_every=10"),
        ({"overlap_steps": -1}, "integer >= 0 or 'auto'"),
        ({"overlap_steps": 2.5}, "integer >= 0 or 'auto'"),
        ({"overlap_steps": True}, "integer >= 0 or 'auto'"),
        ({"overlap_steps": "sometimes"}, "integer >= 0 or 'auto'"),
        ({"overlap_merge": "torchft"}, "predict_correct"),
    ],
)
@pytest.mark.parametrize("cls",
                         [lightning_loco.NoLoCoStrategy, lightning_loco.DiLoCoStrategy, lightning_loco.GASLoCStrategy])
def test_bad_overlap_arguments_fail_when_the_strategy_is_built(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(sync_every=10, **kwargs)


def test_good_overlap_arguments():
    for steps in (0, 1, 9, "auto"):
        assert Options.build(NoLoCo(), 10, overlap_steps=steps).overlap_steps == steps
    assert Options.build(NoLoCo(), 10, overlap_steps=3, overlap_merge="delayed").overlap_merge == "delayed"
    s = lightning_loco.GASLoCStrategy(sync_every=8, overlap_steps="auto", overlap_merge="delayed")
    assert (s.overlap_steps, s.overlap_merge) == ("auto", "delayed")


def test_auto_overlap_picks_the_smallest_hiding_tau_within_the_cap():
    assert auto_cap(50, NoLoCo().overlap_share) == 25 and auto_cap(50, DiLoCo().overlap_share) == 12
    assert auto_cap(50, GASLoC().overlap_share) == 12
    auto = AutoOverlap(cap=12)
    assert auto.choose() == 0  # nothing measured yet: the first round is synchronous
    for _ in range(5):
        auto.observe_step(0.1)
    auto.observe_step(30.0)  # a validation pass between two steps does not steer τ
    auto.observe_exchange(0.42)
    assert auto.choose() == 5 and not auto.cannot_hide  # ⌈0.42 / 0.1⌉
    auto.observe_exchange(3.0)
    auto.observe_exchange(3.0)
    assert auto.choose() == 12 and auto.cannot_hide and auto.needed == 30
    assert AutoOverlap(cap=0).choose() == 0  # H < 4: nothing to overlap


def test_gasloc_state_keeps_the_payload_of_a_round_in_flight():
    alg = GASLoC()
    sim, live = warmed_up(alg)
    state = sim.states[0]
    assert "z" not in state.state_dict()
    z = alg.payload(state, live[0])
    saved = snapshot(state)
    assert torch.equal(saved["z"], z)
    fresh = alg.init_state(torch.zeros(6), [torch.Size([2, 3])])
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.z, z) and torch.equal(fresh.anchor, state.anchor)
    total = z * 2
    assert torch.equal(alg.apply(fresh, total.clone(), 2), alg.apply(state, total.clone(), 2))
