"""The training simulator with modelled step times (``step_seconds``) and per-replica H_i (``sync_seconds``).

Each simulated replica runs on a virtual clock that moves by its modelled step time and, at an
exchange, to the time the last member of its group posted. The paced runs are checked against the
driver itself on the in-process transport (``tests/test_pacing.py``'s replicas, each in a thread of
its own on its own clock): the same model and targets give the same rounds, H_i and groups, and
bitwise the same weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_loco.algorithms import DiLoCo, NoLoCo
from lightning_loco.replica.options import PacingConfig
from lightning_loco.simulator import TrainingSimulator

from test_driver import SLOT_SHAPES, assert_same, initial_weights, inner_lr, targets
from test_pacing import MAKERS, expected_h, paced, threaded

SPEEDS = (1.0, 1.0, 2.0, 4.0)


class Pull(nn.Module):
    """test_driver's model as a module: loss ½‖θ − target‖², whose gradient is θ − target exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(w) for w in initial_weights(SLOT_SHAPES[0], seed=0)])


def pull_loss(module: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return sum(0.5 * (p - t).pow(2).sum() for p, t in zip(module.weights, batch))


class PlainStep(torch.optim.Optimizer):
    """θ ← θ − lr·g, written as test_driver's replicas write their inner step."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 1.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(p.grad.mul(group["lr"]))


def plain_optimizer(module: nn.Module):
    optimizer = PlainStep(module.parameters())
    # the simulator steps the scheduler after each optimizer step, and then on to the run's nominal progress:
    # a step runs at inner_lr(k + 1) after k scheduler steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: inner_lr(done + 1))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def simulator(make, speeds=SPEEDS, sync_every=8, sync_seconds=6.0, max_steps=24, **kwargs) -> TrainingSimulator:
    shards = [[targets(i, 0, SLOT_SHAPES[0])] for i in range(len(speeds))]
    merge = kwargs.pop("merge", "mean")
    return TrainingSimulator(Pull(), shards, make(), sync_every=sync_every, optimizers=plain_optimizer,
                             loss=pull_loss, batched=False, max_steps=max_steps, step_seconds=list(speeds),
                             pacing=None if sync_seconds is None else PacingConfig(sync_seconds, merge=merge), **kwargs)


def fields(report):
    return (report.outer_step, report.inner_step, report.phase_steps, report.compute_seconds, report.peers,
            report.final)


@pytest.mark.parametrize("name", ["noloco", "gasloc", "diloco"])
def test_a_paced_simulated_run_is_the_drivers_paced_run(name):
    speeds, H, T, max_steps = SPEEDS, 8, 6.0, 24  # H_i = 6, 6, 3, 1; ⌈24 / 8⌉ = 3 rounds
    sim = simulator(MAKERS[name], speeds, H, T, max_steps)
    sim.run_rounds()
    sim.finish()
    _, replicas = paced(MAKERS[name], speeds, H, T, max_steps, follow_nominal=True)
    threaded(replicas)
    n, schedule = len(speeds), MAKERS[name]().schedule
    for i, (driver, replica) in enumerate(zip(sim.drivers, replicas)):
        h = expected_h(speeds[i], H, T)
        mine, theirs = driver.reports, replica.driver.reports
        assert [r.phase_steps for r in mine] == [h] * 3  # H_i follows the replica's speed
        assert [fields(r) for r in mine] == [fields(r) for r in theirs]  # the same rounds, groups and phases
        assert [r.peers for r in mine] == [schedule(t, n).peers_of(i) for t in range(3)]
        assert_same(sim.flats[i].gather(), replica.flat.gather(), f"replica {i}'s weights at the end")
        assert_same(driver.slots[0].state.anchor, replica.driver.slots[0].state.anchor, f"replica {i}'s anchor")
        # the virtual clock waits at the exchange for the last member: the 4x replica (4 s a round) for a
        # partner that posts at 6 s, and nobody else waits (every group's last poster takes 6 s)
        assert [r.compute_share for r in mine] == [4 / 6 if speeds[i] == 4 else 1.0] * 3
        assert sim.time.clocks[i].now == 18.0 and sim.time.compute[i] == 3 * h * speeds[i]
    for t in range(3):  # partners agree: j met i at round t exactly when i met j
        met = {(i, j) for i, d in enumerate(sim.drivers) for j in d.reports[t].peers}
        assert met == {(j, i) for i, j in met}
    assert sim.step_count == 18 and sim.rounds_done == 3


def test_paced_rounds_one_at_a_time_with_a_callback_and_the_schedules_follow_nominal_progress():
    sim = simulator(NoLoCo)
    seen = []
    sim.run_rounds(2, callback=lambda s: seen.append((s.rounds_done, s.time.wall_seconds)))
    assert seen == [(1, 6.0), (2, 12.0)]
    for context, driver in zip(sim.contexts, sim.drivers):
        assert context.trainer.strategy.nominal_step == driver.nominal_step() == 16.0  # t·H after two rounds
    with pytest.raises(ValueError, match="the run is 3 rounds .* 2 are done: 2 more do not fit"):
        sim.run_rounds(2)
    sim.run_rounds()
    assert sim.rounds_done == 3 and all(d.reports[-1].final for d in sim.drivers)


def test_a_ten_times_slower_replica_takes_one_step_a_round_and_is_waited_for_no_longer_than_that_step():
    # T = 4 s: the fast replicas take 4 steps of 1 s, the 10x one 1 step of 10 s. The round count is agreed,
    # so the run goes at the straggler's pace of one step a round: 10 s a round on every clock, where one H
    # for all (8 steps of 10 s) takes 80 s a round.
    speeds, H = (1.0, 1.0, 1.0, 10.0), 8
    for sync_seconds, round_seconds in ((4.0, 10.0), (None, 80.0)):
        sim = simulator(NoLoCo, speeds, sync_every=H, sync_seconds=sync_seconds, max_steps=5 * H)
        walls: list[tuple[float, float]] = []
        sim.run_rounds(callback=lambda s, seen=walls: seen.append((s.time.clocks[3].now, s.time.wall_seconds)))
        assert walls == [(round_seconds * (t + 1), round_seconds * (t + 1)) for t in range(5)]
        assert sim.time.compute_share(3) == 1.0  # it is the last to post every round: it never waits
    assert [r.phase_steps for r in sim.drivers[3].reports] == [H] * 5  # (the last run: one H)
    paced_sim = simulator(NoLoCo, speeds, sync_every=H, sync_seconds=4.0, max_steps=5 * H)
    paced_sim.run_rounds()
    assert [r.phase_steps for r in paced_sim.drivers[3].reports] == [1] * 5
    assert all(len(r.peers) == 1 for d in paced_sim.drivers for r in d.reports)  # never left out of a round
    assert all(r.phase_steps == 4 for d in paced_sim.drivers[:3] for r in d.reports)


def test_fixed_h_with_modelled_step_times_is_bitwise_the_plain_run_and_waits_for_the_slowest():
    def run(**kwargs):
        shards = [[targets(i, 0, SLOT_SHAPES[0])] for i in range(4)]
        sim = TrainingSimulator(Pull(), shards, DiLoCo(), sync_every=4, optimizers=plain_optimizer, loss=pull_loss,
                                batched=False, max_steps=12, **kwargs)
        history = []
        for _ in range(12):
            sim.step()
            history.append(sim.weights())
        return sim, history

    plain, plain_history = run()
    timed, timed_history = run(step_seconds=list(SPEEDS))
    for a, b in zip(plain_history, timed_history):
        for x, y in zip(a, b):
            assert_same(x, y, "fixed H with and without modelled step times")
    # DiLoCo's all-reduce waits for the 4x replica every round: shares 1/4, 1/4, 1/2, 1
    assert [timed.time.compute_share(i) for i in range(4)] == [0.25, 0.25, 0.5, 1.0]
    assert [r.compute_share for r in timed.drivers[0].reports] == [0.25] * 3
    assert timed.time.wall_seconds == 3 * 4 * 4.0


def test_fixed_h_rounds_are_h_steps_of_every_replica_and_the_last_ends_at_max_steps():
    def make():
        shards = [[targets(i, 0, SLOT_SHAPES[0])] for i in range(4)]
        return TrainingSimulator(Pull(), shards, NoLoCo(), sync_every=4, optimizers=plain_optimizer, loss=pull_loss,
                                 batched=False, max_steps=10, step_seconds=list(SPEEDS))

    by_rounds, by_steps = make(), make()
    seen = []
    by_rounds.run_rounds(callback=lambda s: seen.append((s.step_count, s.rounds_done)))
    by_steps.run(10)
    assert seen == [(4, 1), (8, 2), (10, 3)]  # ⌈10 / 4⌉ rounds: the last one two steps long
    for a, b in zip(by_rounds.weights(), by_steps.weights()):
        assert_same(a, b, "run_rounds() against step() by step")
    with pytest.raises(ValueError, match="the run is 3 rounds"):
        by_rounds.run_rounds(1)


@pytest.mark.parametrize("kwargs,match", [
    ({"step_seconds": None}, "give step_seconds=\\[...\\]"),
    ({"max_steps": None}, "sync_seconds needs max_steps"),
    ({"batched": True}, "use batched=False or 'auto'"),
    ({"pacing": 0.0}, "sync_seconds must be a number of seconds > 0"),
    ({"step_seconds": [1.0, 2.0]}, "step_seconds must give each of the 4 replicas"),
    ({"step_seconds": [1.0, 1.0, 0.0, 1.0]}, "a number of seconds > 0"),
    ({"step_seconds": [1.0, True, 1.0, 1.0]}, "step_seconds must give"),
    ({"step_seconds": "1111"}, "step_seconds must give"),
    ({"pacing": None, "overlap_steps": 1}, "step_seconds serves synchronous rounds only"),
])
def test_bad_modelled_time_arguments_fail_when_the_simulator_is_built(kwargs, match):
    options = {"step_seconds": list(SPEEDS), "pacing": 6.0, "max_steps": 24, "batched": False, **kwargs}
    shards = [[targets(i, 0, SLOT_SHAPES[0])] for i in range(4)]
    with pytest.raises(ValueError, match=match):
        TrainingSimulator(Pull(), shards, NoLoCo(), sync_every=8, optimizers=plain_optimizer, loss=pull_loss, **options)


def test_modelled_time_needs_an_algorithm_and_paced_runs_take_rounds_not_steps():
    shards = [[targets(i, 0, SLOT_SHAPES[0])] for i in range(4)]
    with pytest.raises(ValueError, match="give an algorithm with it"):
        TrainingSimulator(Pull(), shards, None, optimizers=plain_optimizer, loss=pull_loss, step_seconds=list(SPEEDS))
    with pytest.raises(ValueError, match="call run_rounds"):
        simulator(NoLoCo).step()
