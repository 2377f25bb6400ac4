"""``merge="steps"``: under ``sync_seconds`` a group's payloads weighted by each member's inner steps H_i.

The driver runs on the in-process transport with an injected clock per replica (``tests/test_pacing.py``'s
replicas), and every round is checked against a float64 reference of the weighted merge fed with the
snapshots each replica posted and the H_i it took: DiLoCo's Δ̄ = Σ H_i·Δ_i / Σ H_j with its Nesterov
outer SGD, NoLoCo's δ_i ← α·δ_i + β·(Σ_j H_j·θ_j / Σ_j H_j − φ_i) over groups of two and three.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.algorithms.step_weighted import StepWeighted, WeightedState
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.replica.options import PacingConfig
from lightning_loco.rules import build_options
from lightning_loco.simulator import TrainingSimulator
from lightning_loco.trainer import DiLoCoStrategy, GASLoCStrategy, NoLoCoStrategy
from lightning_loco.transport import InProcessNetwork

from test_pacing import expected_h, paced, threaded

D64 = torch.float64


def reference(make, replicas, rounds: int) -> list[list[Tensor]]:
    """The anchors after each round, in float64, from the posted snapshots and each replica's H_i."""
    algorithm, n = make(), len(replicas)
    phi = [r.initial.to(D64) for r in replicas]
    momentum: list[Tensor | None] = [None] * n  # DiLoCo's SGD buffer (one, shared) or NoLoCo's δ_i
    delta = [torch.zeros_like(p) for p in phi]
    out = []
    for t in range(rounds):
        steps = [r.driver.reports[t].phase_steps for r in replicas]
        theta = [r.snapshots[t].to(D64) for r in replicas]
        if algorithm.name == "diloco":  # g = −Σ H_i·(θ_i − φ) / Σ H_j; SGD(lr, momentum m, Nesterov) on φ
            g = -sum(h * (x - phi[0]) for h, x in zip(steps, theta)) / sum(steps)
            buf = g.clone() if momentum[0] is None else momentum[0] * algorithm.outer_momentum + g
            momentum[0] = buf
            phi = [phi[0] - algorithm.outer_lr * (g + algorithm.outer_momentum * buf)] * n
        else:  # γ = β: δ_i ← α·δ_i + β·(θ̄_w − φ_i), φ_i ← φ_i + δ_i
            new = list(phi)
            for group in algorithm.schedule(t, n).groups:
                mean = sum(steps[j] * theta[j] for j in group) / sum(steps[j] for j in group)
                for i in group:
                    delta[i] = algorithm.outer_momentum * delta[i] + algorithm.outer_lr * (mean - phi[i])
                    new[i] = phi[i] + delta[i]
            phi = new
        out.append(phi)
    return out


@pytest.mark.parametrize("name,speeds", [("diloco", (1, 2, 3)), ("noloco", (1, 2, 3)), ("noloco", (1, 1, 2, 4))])
def test_each_round_is_the_step_weighted_merge_in_closed_form(name, speeds):
    # H = T = 6: H_i = 6, 3, 2 (speeds 1, 2, 3; NoLoCo: one group of three) or 6, 6, 3, 1 (two pairs)
    make = {"diloco": DiLoCo, "noloco": NoLoCo}[name]
    H, T, rounds = 6, 6.0, 3
    _, replicas = paced(make, speeds, H, T, max_steps=rounds * H, merge="steps")
    threaded(replicas)
    expected = reference(make, replicas, rounds)
    for r in replicas:
        assert [x.phase_steps for x in r.driver.reports] == [expected_h(r.speed, H, T)] * rounds
        assert isinstance(r.driver.slots[0].state, WeightedState)
        for t in range(rounds):
            torch.testing.assert_close(r.anchors[t].to(D64), expected[t][r.i], rtol=1e-5, atol=1e-6)
    # the plain mean on the same schedule differs (the H_i are unequal), so the test can tell them apart
    _, plain = paced(make, speeds, H, T, max_steps=rounds * H)
    threaded(plain)
    assert not all(torch.allclose(p.anchors[-1], r.anchors[-1], rtol=1e-3, atol=1e-4) for p, r in zip(plain, replicas))


def test_each_replica_sends_its_h_i_exactly_with_the_payload():
    algorithm = StepWeighted(NoLoCo())
    state = algorithm.init_state(torch.zeros(3), [torch.Size([3])])
    algorithm.phase_ended(state, 7)
    payload = algorithm.payload(state, torch.tensor([1.0, -2.0, 0.5]))
    assert payload.tolist() == [7.0, -14.0, 3.5, 7.0] and algorithm.payload_numel(state) == 4
    # a group's sum: Σ H_i·θ_i and Σ H_j; the final weights are the weighted mean (7·θ + 1·θ') / 8
    other = torch.tensor([9.0, 6.0, 0.5, 1.0])  # H = 1, θ' = (9, 6, 0.5)
    assert algorithm.final_weights(state, payload + other, 2).tolist() == [2.0, -1.0, 0.5]


def test_a_simulated_run_weights_each_replica_by_its_steps_in_closed_form():
    # Two replicas of step times 1 and 2 s, T = H = 4: H_i = 4 and 2. Every inner step moves θ by −lr·c
    # (the loss is c·θ), so Δ_i = −lr·H_i·c and the step-weighted mean is −lr·c·(4·4 + 2·2) / (4 + 2).
    c, lr = torch.tensor([1.0, -2.0, 0.5, 4.0]), 0.25
    start = torch.tensor([0.5, 1.0, -1.5, 2.0])

    def one_round(algorithm, merge):
        module = nn.Module()
        module.w = nn.Parameter(start.clone())
        sim = TrainingSimulator(module, [[torch.zeros(1)] * 8] * 2, algorithm, sync_every=4, batched=False,
                                optimizers=lambda m: torch.optim.SGD(m.parameters(), lr=lr),
                                loss=lambda m, batch: (m.w * c).sum(), max_steps=8, step_seconds=[1.0, 2.0],
                                pacing=PacingConfig(4.0, merge=merge), track_norms=False)
        sim.run_rounds(1)  # the first of two rounds: an ordinary outer step, not the final average
        assert [d.reports[0].phase_steps for d in sim.drivers] == [4, 2]
        return [flat.gather() for flat in sim.flats]

    for make, outer_lr in ((lambda: DiLoCo(outer_lr=1.0, outer_momentum=0.0), 1.0),  # φ ← φ + Δ̄
                           (lambda: NoLoCo(seed=0), NoLoCo().outer_lr)):  # δ = 0: φ ← φ + β·(θ̄ − φ)
        for got in one_round(make(), "steps"):
            torch.testing.assert_close(got, start + outer_lr * (-lr * c * (4 * 4 + 2 * 2) / (4 + 2)))
        for got in one_round(make(), "mean"):  # the plain mean: −lr·c·(4 + 2) / 2
            torch.testing.assert_close(got, start + outer_lr * (-lr * c * (4 + 2) / 2))


# ---------------------------------------------------------------------------- bad arguments


def driver(make=NoLoCo, **kwargs) -> OuterStepDriver:
    """A driver of options the rule table let through (as every strategy and the simulator build them)."""
    return OuterStepDriver(build_options(make(), 4, **kwargs), InProcessNetwork(2).transport(0))


STEPS = PacingConfig(1.0, merge="steps")


@pytest.mark.parametrize("kwargs,match", [
    ({"pacing": PacingConfig(1.0, merge="tokens")}, "merge must be 'mean'.*or 'steps'"),
    ({"pacing": STEPS, "wire": "bfloat16"}, "would round it. Use wire='float32' with merge='steps'"),
])
def test_bad_merges_fail_when_the_driver_s_options_are_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        driver(**kwargs)
    with pytest.raises(ValueError, match="does not serve gasloc: its gossip mix must stay mean-preserving"):
        driver(GASLoC, pacing=STEPS)
    assert driver(pacing=1.0).algorithm.name == "noloco"  # the plain mean: the algorithm itself
    assert type(driver(pacing=STEPS).algorithm) is StepWeighted


@pytest.mark.parametrize("kwargs,match", [
    ({"pacing": PacingConfig(1.0, merge="Steps")}, "merge must be 'mean'"),
    ({"pacing": STEPS, "wire": "int8"}, "would round it"),
    ({"pacing": STEPS, "wire": "float16"}, "would round it"),
])
@pytest.mark.parametrize("cls", [NoLoCoStrategy, DiLoCoStrategy])
def test_bad_merges_fail_when_the_strategy_is_built(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(sync_every=10, **kwargs)
    assert cls(sync_every=10, pacing=PacingConfig(2.5, merge="steps")).options.merge == "steps"
    assert cls(sync_every=10).options.merge == "mean"


def test_gasloc_refuses_the_weighted_merge_when_the_strategy_is_built():
    with pytest.raises(ValueError, match="mean-preserving.*Use merge='mean' with it"):
        GASLoCStrategy(sync_every=10, pacing=PacingConfig(2.5, merge="steps"))


# ---------------------------------------------------------------------------- real processes (slow tier)


@pytest.mark.slow
def test_real_processes_resume_the_weighted_merge_exactly_and_it_changes_the_weights(tmp_path):
    """The strategy's ``merge`` reaches the driver: two processes on their own clocks (speeds 1 and 2,
    H_i = 4 and 2), resumed bitwise from a round checkpoint, and unlike the plain mean's run."""
    import tiny
    from test_checkpoints import assert_same_tree

    ckpts = tmp_path / "ckpts"
    pacing = {"sync_seconds": 4.0, "merge": "steps"}
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": 4, "pacing": pacing},
              "devices": 2, "max_steps": 16, "batch_size": 24, "virtual_step_seconds": [1.0, 2.0],
              "outer_checkpoint": {"dirpath": str(ckpts), "every_n_outer_steps": 2}}
    straight = tiny.launch(tmp_path / "straight", **common)
    assert [[r["phase_steps"] for r in rec["reports"]] for rec in straight] == [[4] * 4, [2] * 4]
    resumed = tiny.launch(tmp_path / "resumed", ckpt_path=str(ckpts / "outer_step=2.ckpt"), **common)
    for r, done in enumerate([8, 4]):  # each replica resumes at its own step
        assert len(straight[r]["weights"]) - len(resumed[r]["weights"]) == done
        for step, (a, b) in enumerate(zip(straight[r]["weights"][done:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, done + step)
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")
    plain_config = {k: v for k, v in common.items() if k != "outer_checkpoint"}
    plain_config["strategy_kwargs"] = {"sync_every": 4, "pacing": {"sync_seconds": 4.0}}  # merge="mean"
    plain = tiny.launch(tmp_path / "plain", **plain_config)
    assert not torch.equal(plain[0]["weights"][-1], straight[0]["weights"][-1])
