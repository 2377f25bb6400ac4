"""The elastic plug-in and transport in one process, over a scripted membership (tests/elastic_fakes.py).

The driver, :class:`ElasticPlugin` and :class:`ElasticTransport` are the real ones; only torchft's
Lighthouse and process group are replaced. Replicas run in threads, since elastic rounds block.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from elastic_fakes import FakeMembership, Hub, Script, flat_of

from lightning_loco.algorithms import DiLoCo, NoLoCo
from lightning_loco.driver import OuterStepDriver
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.plugin import ElasticPlugin, checksum
from lightning_loco.elastic.transport import ElasticTransport
from lightning_loco.flat import FlatParameters
from lightning_loco.plugins import DriverPlugin, Landing, Outcome
from lightning_loco.transport import InProcessNetwork

CPU = torch.device("cpu")
H = 3


class Runner:
    """One replica: a parameter pulled towards its own target by plain steps, and its driver."""

    def __init__(self, index: int, transport, plugin=None, algorithm=None) -> None:
        self.param = flat_of([float(index), 1.0 - index, 0.5 * index])
        self.target = torch.tensor([2.0 + index, -1.0, 3.0 * index])
        algorithm = algorithm if algorithm is not None else NoLoCo()
        self.driver = OuterStepDriver(algorithm, transport, H, plugin=plugin, final_outer_step="outer")
        self.driver.add(FlatParameters([self.param], CPU))
        self.driver.before_training()

    def inner_step(self) -> None:
        with torch.no_grad():
            self.param.sub_(0.25 * (self.param - self.target))

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.inner_step()
            self.driver.after_inner_step(0)


def elastic_runner(hub: Hub, replica_id: str, index: int, script, algorithm=None) -> Runner:
    config = ElasticConfig(lighthouse="127.0.0.1:1", replica_id=replica_id)
    transport = ElasticTransport(config, membership=FakeMembership(hub, replica_id, script))
    return Runner(index, transport, ElasticPlugin(transport), algorithm)


def in_threads(*jobs) -> None:
    errors: list[BaseException] = []

    def guard(job):
        try:
            job()
        except BaseException as err:  # noqa: BLE001  (handed to the test)
            errors.append(err)

    threads = [threading.Thread(target=guard, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a replica thread hung"
    if errors:
        raise errors[0]


def build_in_threads(*builders):
    """Builds runners in threads (a joiner's ``before_training`` waits for its donor)."""
    built: dict[int, Runner] = {}
    in_threads(*[lambda i=i, b=b: built.__setitem__(i, b()) for i, b in enumerate(builders)])
    return [built[i] for i in range(len(builders))]


@pytest.mark.parametrize("make", [NoLoCo, DiLoCo], ids=["noloco", "diloco"])
def test_elastic_rounds_equal_the_static_drivers_bitwise(make):
    n, rounds = 3, 4
    ids = ("a", "b", "c")
    script = [Script(quorum_id=1, switch=0, members=ids)]
    hub = Hub()
    elastic = [elastic_runner(hub, r, i, script, make()) for i, r in enumerate(ids)]
    network = InProcessNetwork(n)
    static = [Runner(i, network.transport(i), algorithm=make()) for i in range(n)]
    in_threads(*[lambda r=r: r.run(rounds * H) for r in elastic])
    in_threads(*[lambda r=r: r.run(rounds * H) for r in static])
    for e, s in zip(elastic, static):
        assert torch.equal(e.param.detach(), s.param.detach())
        assert torch.equal(e.driver.slots[0].state.anchor, s.driver.slots[0].state.anchor)
    records = [r.driver.plugin.rounds for r in elastic]
    assert [[x["outer_step"] for x in rec] for rec in records] == [list(range(rounds))] * n
    for t in range(rounds):  # partners agree: each group is the same seen from each of its members
        groups = {ids[i]: tuple(records[i][t]["group"]) for i in range(n)}
        assert all(groups[m] == g for g in groups.values() for m in g)
        assert not any(records[i][t]["alone"] for i in range(n))


def test_a_partner_that_died_leaves_the_round_to_be_taken_alone():
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a, b = elastic_runner(hub, "a", 0, script), elastic_runner(hub, "b", 1, script)
    in_threads(lambda: a.run(H), lambda: b.run(H))  # round 0 together
    hub.kill("b")
    a.run(H - 1)
    a.inner_step()
    slot = a.driver.slots[0]
    alone_state, weights = copy.deepcopy(slot.state), slot.flat.gather()
    expected = a.driver.algorithm.apply(alone_state, a.driver.algorithm.payload(alone_state, weights), 1)
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.driver.after_inner_step(0)  # round 1: b is gone
    assert torch.equal(a.param.detach(), expected)  # the outer step of a group of one
    a.run(H)  # round 2: the membership's group is broken, taken alone without posting
    rounds = a.driver.plugin.rounds
    assert [(r["outer_step"], r["alone"], r["dropped"]) for r in rounds] == [
        (0, False, False), (1, True, False), (2, True, False)]
    membership = a.driver.transport.membership
    assert membership.failures == 1 and not membership.view.ok
    assert [f["peers"] for f in a.driver.transport.failures] == [["b"]]


def test_diloco_drops_a_round_whose_all_reduce_failed():
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a = elastic_runner(hub, "a", 0, script, DiLoCo())
    b = elastic_runner(hub, "b", 1, script, DiLoCo())
    in_threads(lambda: a.run(H), lambda: b.run(H))
    hub.kill("b")
    a.run(H - 1)
    a.inner_step()
    anchor, weights = a.driver.slots[0].state.anchor.clone(), a.param.detach().clone()
    reports = len(a.driver.reports)
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.driver.after_inner_step(0)
    assert torch.equal(a.driver.slots[0].state.anchor, anchor)  # outer state unchanged
    assert torch.equal(a.param.detach(), weights)  # nothing applied to the live weights
    assert len(a.driver.reports) == reports  # a dropped round leaves no report
    assert a.driver.plugin.rounds[-1]["dropped"] and a.driver.plugin.committed == 1


def test_a_joiner_heals_from_its_donor_and_takes_part_from_the_switch():
    hub = Hub()
    script = [Script(1, 0, ("a", "b")), Script(2, 2, ("a", "b", "c"), joiners=("c",), donor="a")]
    a, b = elastic_runner(hub, "a", 0, script), elastic_runner(hub, "b", 1, script)
    c_box: list[Runner] = []
    # c's before_training waits for a's state, which a sends at the switch before round 2
    in_threads(lambda: a.run(5 * H), lambda: b.run(5 * H),
               lambda: (c_box.append(elastic_runner(hub, "c", 2, script)), c_box[0].run(3 * H)))
    (c,) = c_box
    healed, exported = c.driver.plugin.healed_from, a.driver.plugin.exported
    assert [h["donor"] for h in healed] == ["a"] and healed[0]["outer_step"] == 2
    assert healed[0]["checksum"] == exported[0]["checksum"]  # c took a's weights at the switch
    assert c.driver.slots[0].outer_steps == a.driver.slots[0].outer_steps == 5
    assert c.driver.slots[0].inner_steps == a.driver.slots[0].inner_steps == 5 * H
    records = {r: x.driver.plugin.rounds for r, x in zip("abc", (a, b, c))}
    assert [x["outer_step"] for x in records["c"]] == [2, 3, 4]
    for t in (2, 3, 4):
        groups = {r: tuple(rec[t - (2 if r == "c" else 0)]["group"]) for r, rec in records.items()}
        assert all(groups[m] == g for g in groups.values() for m in g)
    assert checksum([c.param.detach()]) != checksum([torch.zeros(3)])


def test_plugin_hooks_run_in_order_around_rounds():
    class Recorder(DriverPlugin):
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def before_training(self) -> None:
            self.calls.append(("before_training",))

        def before_round(self, optimizer_index: int, outer_step: int) -> None:
            self.calls.append(("before_round", outer_step))

        def after_landing(self, landing: Landing) -> None:
            self.calls.append(("after_landing", landing.outer_step, landing.outcome, landing.final))

        def close(self) -> None:
            self.calls.append(("close",))

    network = InProcessNetwork(1)
    recorder = Recorder()
    runner = Runner(0, network.transport(0), plugin=recorder)
    runner.run(2 * H - 1)
    runner.inner_step()
    runner.driver.after_inner_step(0, last=True)
    runner.driver.close()
    assert recorder.calls == [
        ("before_training",), ("before_round", 0), ("after_landing", 0, Outcome.EXCHANGED, False),
        ("before_round", 1), ("after_landing", 1, Outcome.EXCHANGED, False), ("close",),
    ]


def test_elastic_plugin_needs_an_elastic_transport():
    with pytest.raises(TypeError, match="ElasticTransport"):
        ElasticPlugin(InProcessNetwork(1).transport(0))
