"""A live partner that is late (``straggler_timeout``), in one process over the scripted membership and
in-process process group of tests/elastic_fakes.py.

The late replica is made late by an event, not by a clock: it posts round 1 only once its partner's
round 1 has landed, so its partner must have given up on it. Nothing here asserts seconds.
"""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch

from lightning_loco.algorithms import DiLoCo, NoLoCo
from lightning_loco.elastic.config import ElasticConfig

from elastic_fakes import H, Hub, Script, elastic_runner, in_threads

STRAGGLER_TIMEOUT = 1.0  # long enough that the healthy rounds of two threads on a loaded machine make it


def alone_step(runner):
    """What ``runner``'s next landing gives if it takes the round alone: the outer step of a group of one."""
    slot = runner.driver.slots[0]
    state, weights = copy.deepcopy(slot.state), slot.flat.gather()
    return runner.driver.algorithm.apply(state, runner.driver.algorithm.payload(state, weights), 1)


def late_in_round_one(make, caplog):
    """a and b meet in round 0; b reaches round 1 only after a's round 1 landed; both start round 2 once b's
    round 1 landed, and meet again there.
    Returns the runners and what each would have computed alone in round 1."""
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a, b = (elastic_runner(hub, r, i, script, make(), straggler_timeout=STRAGGLER_TIMEOUT) for i, r in enumerate("ab"))
    a_landed, b_landed = threading.Event(), threading.Event()
    expected: dict[str, torch.Tensor] = {}

    def run_a() -> None:
        a.run(2 * H - 1)
        a.inner_step()
        expected["a"] = alone_step(a)
        a.driver.after_inner_step(0)  # round 1: b is not there; a gives up after straggler_timeout
        a_landed.set()
        assert b_landed.wait(30)  # so that round 2 starts together, however loaded the machine
        a.run(H)

    def run_b() -> None:
        b.run(H)
        assert a_landed.wait(30)
        b.run(H - 1)
        b.inner_step()
        expected["b"] = alone_step(b)
        b.driver.after_inner_step(0)  # round 1, late: a gave up on it, so b takes it alone too, at once
        expected["b_after_1"] = b.param.detach().clone()
        b_landed.set()
        b.run(H)

    with caplog.at_level(logging.INFO, logger="lightning_loco"):
        in_threads(run_a, run_b)
    return a, b, expected


def test_a_late_partner_is_left_out_of_one_round_and_both_take_it_alone(caplog):
    a, b, expected = late_in_round_one(NoLoCo, caplog)
    for runner in (a, b):
        rounds = runner.driver.plugin.rounds
        assert [(r["outer_step"], r["alone"], r["dropped"]) for r in rounds] == [
            (0, False, False), (1, True, False), (2, False, False)]
        membership = runner.driver.transport.membership
        assert membership.failures == 0 and membership.view.ok  # the group stays: nobody failed
        assert runner.driver.transport.failures == []
        assert runner.driver.slots[0].outer_steps == 3  # the round counts stay agreed
    assert torch.equal(expected["b_after_1"], expected["b"])  # b's round 1 was the outer step of a group of one
    assert [(x["outer_step"], x["peers"], x["gave_up"]) for x in a.driver.transport.late] == [(1, ["b"], True)]
    assert [(x["outer_step"], x["peers"], x["gave_up"]) for x in b.driver.transport.late] == [(1, ["a"], False)]
    assert [r.peer_ids for r in a.driver.reports] == [("b",), ("b",), ("b",)]
    # the report, and so the monitor's line, says that round 1 met nobody, as the replica's own line does
    assert [r.alone for r in a.driver.reports] == [False, True, False]
    from lightning_loco.trainer.monitoring import OuterStepMonitor

    assert OuterStepMonitor._peer_text(a.driver.reports[1], "a") == \
        "outer step 1: replica a met nobody (taken alone, without b)"
    messages = [r.getMessage() for r in caplog.records]
    assert any("outer step 1 taken alone" in m and "not at the exchange within straggler_timeout=1 s" in m
               for m in messages)
    assert any("outer step 1 taken alone" in m and "gave up waiting for this replica" in m for m in messages)


def test_diloco_drops_the_round_of_a_late_member_on_every_member(caplog):
    a, b, _ = late_in_round_one(DiLoCo, caplog)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("outer step 1 dropped" in m for m in messages) == 2
    for runner in (a, b):
        rounds = runner.driver.plugin.rounds
        assert [(r["outer_step"], r["alone"], r["dropped"]) for r in rounds] == [
            (0, False, False), (1, True, True), (2, False, False)]
        assert runner.driver.plugin.committed == 2  # round 1 dropped by both: their counts agree
        assert runner.driver.transport.membership.failures == 0
    # both dropped round 1 and both applied the same rounds 0 and 2 (the fakes start from different anchors)
    start = [torch.tensor([float(i), 1.0 - i, 0.5 * i]) for i in (0, 1)]
    states = [a.driver.slots[0].state, b.driver.slots[0].state]
    assert torch.equal(states[0].gradient, states[1].gradient)
    assert torch.allclose(states[0].anchor - states[1].anchor, start[0] - start[1])


def test_healthy_rounds_with_a_straggler_timeout_equal_those_without_bitwise():
    hub, plain_hub = Hub(), Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b", "c"))]
    timed = [elastic_runner(hub, r, i, script, straggler_timeout=30.0) for i, r in enumerate("abc")]
    plain = [elastic_runner(plain_hub, r, i, script) for i, r in enumerate("abc")]
    in_threads(*[lambda r=r: r.run(4 * H) for r in timed])
    in_threads(*[lambda r=r: r.run(4 * H) for r in plain])
    for x, y in zip(timed, plain):
        assert torch.equal(x.param.detach(), y.param.detach())
        assert not any(r["alone"] for r in x.driver.plugin.rounds) and x.driver.transport.late == []


def test_a_dead_partner_is_still_a_failure_under_a_straggler_timeout():
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a, b = (elastic_runner(hub, r, i, script, straggler_timeout=5.0) for i, r in enumerate("ab"))
    in_threads(lambda: a.run(H), lambda: b.run(H))
    hub.kill("b")
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.run(H)
    assert a.driver.plugin.rounds[-1]["alone"] and a.driver.transport.membership.failures == 1
    assert a.driver.transport.late == []


@pytest.mark.parametrize(
    "value, words", [(0, ["straggler_timeout", "> 0"]), (-1.0, ["straggler_timeout"]), (True, ["straggler_timeout"]),
                     (120, ["below outer_step_timeout=120"])])
def test_bad_straggler_timeouts_fail_when_built(value, words):
    from lightning_loco.algorithms import NoLoCo
    from lightning_loco.rules import build_options

    with pytest.raises(ValueError) as err:  # a field's own check, or the rule elastic-straggler-below-timeout
        build_options(NoLoCo(), 4, elastic=ElasticConfig("127.0.0.1:1", "a", straggler_timeout=value))
    for word in words:
        assert word in str(err.value)


def test_the_strategies_take_a_straggler_timeout():
    from lightning_loco import DiLoCoStrategy, NoLoCoStrategy

    assert NoLoCoStrategy(elastic=ElasticConfig("127.0.0.1:1", straggler_timeout=5)).elastic.straggler_timeout == 5
    assert DiLoCoStrategy(elastic=ElasticConfig("127.0.0.1:1")).elastic.straggler_timeout is None
