"""Elastic replicas of several ranks, in one process: each rank a thread (tests/elastic_fakes.py).

* the transport over scripted memberships: each rank moves its slice on its own group and the replica's
  ranks gather the sum, bitwise the static launch's rounds; a round one rank could not take with its
  partner is taken alone by all the replica's ranks, and the dead replica's other rank stops with an error
  that says to restart the replica;
* the real :class:`~lightning_loco.elastic.membership.Membership` over torchft's Lighthouse (in this
  process), its store and its process groups: rank 0 alone talks to the Lighthouse, every rank takes the
  same membership, rank i of a joiner heals from the donor's rank i, and rank i's process group joins the
  rank i of each member;
* the plan that rank 0 hands on: taken once, an error of rank 0's named, a rank 0 that died named.
"""

from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.plugin import ElasticPlugin
from lightning_loco.elastic.ranks import ReplicaRankError, publish, read
from lightning_loco.elastic.transport import ElasticTransport
from lightning_loco.replica.options import WireConfig
from lightning_loco.transport import InProcessNetwork
from lightning_loco.wire.codecs import roundtrip_segments, segments

from elastic_fakes import FakeMembership, H, Hub, Room, Runner, Script, ThreadRanks, in_threads

SIZE = 11  # values of the tiny problem's parameter: rank 0's slice has 6, rank 1's 5
SHARDS = (7, 4)  # sharded replicas: the values of rank 0's and rank 1's own parts (uneven, as FSDP2's may be)
IDS = ("A", "B")


def ranked_runners(make, hubs: list[Hub], script: list[Script], rooms: dict[str, Room],
                   sharded: bool = False, wire: Any = None, size: int = SIZE) -> dict[tuple[str, int], Runner]:
    """Replica r of IDS as len(hubs) ranks: rank i's memberships over hubs[i] (its own process groups), the
    replica's ranks over rooms[r]; every rank of replica r starts as the static launch's replica r. ``sharded``
    (FSDP2 inside): rank i holds a part of its own, of SHARDS[i] values, as the static launch's replica r would."""
    def build(rid: str, index: int, rank: int) -> Runner:
        config = ElasticConfig(lighthouse="127.0.0.1:1", replica_id=rid)
        transport = ElasticTransport(config, membership=FakeMembership(hubs[rank], rid, script),
                                     ranks=ThreadRanks(rid, rank, rooms[rid]), sharded=sharded)
        return Runner(index, transport, ElasticPlugin(transport), make(), wire, size=SHARDS[rank] if sharded else size)

    return {(rid, rank): build(rid, index, rank) for index, rid in enumerate(IDS) for rank in range(len(hubs))}


@pytest.mark.parametrize("make", [NoLoCo, DiLoCo], ids=["noloco", "diloco"])
def test_each_rank_moves_its_slice_and_the_rounds_equal_the_static_launchs_bitwise(make):
    rounds, k = 3, 2
    hubs, rooms = [Hub() for _ in range(k)], {rid: Room(k) for rid in IDS}
    ranked = ranked_runners(make, hubs, [Script(quorum_id=1, switch=0, members=IDS)], rooms)
    network = InProcessNetwork(len(IDS))
    static = [Runner(i, network.transport(i), algorithm=make(), size=SIZE) for i in range(len(IDS))]
    in_threads(*[lambda r=r: r.run(rounds * H) for r in ranked.values()])
    in_threads(*[lambda r=r: r.run(rounds * H) for r in static])
    for (rid, rank), runner in ranked.items():
        reference = static[IDS.index(rid)]
        assert torch.equal(runner.param.detach(), reference.param.detach()), (rid, rank)
        assert torch.equal(runner.driver.slots[0].state.anchor, reference.driver.slots[0].state.anchor)
        assert [r["alone"] for r in runner.driver.plugin.rounds] == [False] * rounds
    for rid in IDS:  # rank 0 moved 6 of the 11 values, rank 1 the other 5
        sent = [ranked[(rid, rank)].driver.transport.stats.bytes_sent for rank in range(k)]
        assert sent[0] > 0 and sent[0] * 5 == sent[1] * 6, sent


@pytest.mark.parametrize("make", [NoLoCo, DiLoCo, GASLoC], ids=["noloco", "diloco", "gasloc"])
def test_sharded_ranks_move_their_own_shards_whole_and_each_equals_the_static_launch_of_its_part(make):
    """FSDP2 inside the replicas (``sharded``): rank i of each replica holds its own part of the model and
    exchanges all of it with rank i of the others; nothing is sliced or gathered, and each rank's rounds are
    bitwise the static launch's over that part alone."""
    rounds, k = 3, 2
    hubs, rooms = [Hub() for _ in range(k)], {rid: Room(k) for rid in IDS}
    ranked = ranked_runners(make, hubs, [Script(quorum_id=1, switch=0, members=IDS)], rooms, sharded=True)
    in_threads(*[lambda r=r: r.run(rounds * H) for r in ranked.values()])
    for rank, size in enumerate(SHARDS):
        network = InProcessNetwork(len(IDS))
        static = [Runner(i, network.transport(i), algorithm=make(), size=size) for i in range(len(IDS))]
        in_threads(*[lambda r=r: r.run(rounds * H) for r in static])
        for index, rid in enumerate(IDS):
            runner, reference = ranked[(rid, rank)], static[index]
            assert torch.equal(runner.param.detach(), reference.param.detach()), (rid, rank)
            assert torch.equal(runner.driver.slots[0].state.anchor, reference.driver.slots[0].state.anchor)
            assert [r["alone"] for r in runner.driver.plugin.rounds] == [False] * rounds
    for rid in IDS:  # each rank moved its whole part: 7 values and 4
        sent = [ranked[(rid, rank)].driver.transport.stats.bytes_sent for rank in range(k)]
        assert sent[0] > 0 and sent[0] * SHARDS[1] == sent[1] * SHARDS[0], sent


@pytest.mark.filterwarnings("ignore:.*finished the round alone")
def test_a_round_one_rank_could_not_take_is_taken_alone_by_the_whole_replica():
    """B's rank 1 dies after round 0. In round 1 A's rank 1 cannot receive from it while A's rank 0 exchanges
    with B's rank 0 as usual: A's two ranks agree and both take the round alone (the outer step of a group of
    one), and both close their membership's group. B's rank 0 stops with an error that says why and to
    restart the whole replica."""
    k = 2
    hubs, rooms = [Hub(timeout=30.0) for _ in range(k)], {rid: Room(k) for rid in IDS}
    ranked = ranked_runners(NoLoCo, hubs, [Script(quorum_id=1, switch=0, members=IDS)], rooms)
    in_threads(*[lambda r=r: r.run(H) for r in ranked.values()])  # round 0 together
    hubs[1].kill("B")
    rooms["B"].kill()
    expected: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def replica_a(rank: int) -> None:
        runner = ranked[("A", rank)]
        runner.run(H - 1)
        runner.inner_step()
        slot = runner.driver.slots[0]
        state, weights = copy.deepcopy(slot.state), slot.flat.gather()
        expected[rank] = runner.driver.algorithm.apply(state, runner.driver.algorithm.payload(state, weights), 1)
        runner.driver.after_inner_step(0)

    def b_rank_zero() -> None:
        try:
            ranked[("B", 0)].run(H)
        except ReplicaRankError as err:
            errors.append(err)

    in_threads(lambda: replica_a(0), lambda: replica_a(1), b_rank_zero)
    a0, a1 = ranked[("A", 0)], ranked[("A", 1)]
    assert torch.equal(a0.param.detach(), expected[0]) and torch.equal(a1.param.detach(), expected[1])
    assert torch.equal(a0.param.detach(), a1.param.detach())  # one model on the replica's ranks
    for runner in (a0, a1):
        assert [r["alone"] for r in runner.driver.plugin.rounds] == [False, True]
        assert runner.driver.transport.failures[-1]["peers"] == ["B"]
        assert runner.driver.transport.membership.failures == 1 and not runner.driver.transport.membership.view.ok
    assert "another rank of this replica" in a0.driver.transport.failures[-1]["error"]  # rank 0 heard it from rank 1
    assert 1 in hubs[0].aborted and 1 in hubs[1].aborted  # both ranks closed their groups
    assert len(errors) == 1, errors
    message = str(errors[0])
    assert "A rank of replica 'B' stopped or cannot be reached while rank 0 was agreeing" in message, message
    assert "leaves the membership as a whole" in message and "Restart all 2 of its processes" in message


@pytest.mark.filterwarnings("ignore:.*finished the round alone")
def test_a_group_sum_taken_alone_by_two_ranks_delivers_each_slice_as_its_codec_would_and_keeps_the_residual_true():
    """int8 with error feedback, two ranks per replica: each rank encodes its own slice, whose int8 blocks start
    at the slice's start (40 values in blocks of 16, cut 20 | 20: the blocks of the whole payload would straddle
    the cut). B dies after round 0, and A's ranks take round 1 alone: each applies the payload x it would have
    sent as the codec delivers it, slice by slice, and keeps the rest as the residual, so that what was applied
    and what is kept add up to x exactly (and the residual is the one the round computed before posting)."""
    k, size = 2, 40
    wire = WireConfig("int8", block_size=16, error_feedback=True)
    hubs, rooms = [Hub(timeout=30.0) for _ in range(k)], {rid: Room(k) for rid in IDS}
    ranked = ranked_runners(NoLoCo, hubs, [Script(quorum_id=1, switch=0, members=IDS)], rooms, wire=wire, size=size)
    in_threads(*[lambda r=r: r.run(H) for r in ranked.values()])  # round 0 together
    for hub in hubs:
        hub.kill("B")
    rooms["B"].kill()
    codec = wire.resolve(False).codec
    expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def replica_a(rank: int) -> None:
        runner = ranked[("A", rank)]
        runner.run(H - 1)
        runner.inner_step()
        slot, algorithm = runner.driver.slots[0], runner.driver.algorithm
        state = copy.deepcopy(slot.state)
        sent = algorithm.payload(state, slot.flat.gather()) + slot.residual
        delivered = roundtrip_segments(sent, codec, segments(size, k))
        assert not torch.equal(delivered, codec.roundtrip(sent))  # the slices' blocks are not the whole's
        expected[rank] = (algorithm.apply(state, 2 * delivered, 2), sent - delivered)
        runner.driver.after_inner_step(0)

    in_threads(lambda: replica_a(0), lambda: replica_a(1))
    for rank in range(k):
        runner = ranked[("A", rank)]
        assert [r["alone"] for r in runner.driver.plugin.rounds] == [False, True]
        weights, residual = expected[rank]
        assert torch.equal(runner.driver.slots[0].residual, residual)
        assert torch.equal(runner.param.detach(), weights)
    assert torch.equal(ranked[("A", 0)].param.detach(), ranked[("A", 1)].param.detach())


# ---------------------------------------------------------------- the real membership, over a Lighthouse in-process


def test_rank_zero_asks_each_rank_heals_from_the_donors_same_rank_and_forms_its_group_with_it():
    """A of two ranks starts alone; B of two ranks joins. Only the ranks 0 hold Lighthouse clients; every rank
    of both takes the same membership; B's rank i takes A's rank i's state; and rank i's process group joins
    A's rank i with B's rank i (a tensor sent on it arrives at the same rank of the other replica)."""
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    from torchft.coordination import LighthouseServer

    from lightning_loco.elastic.membership import Membership

    k = 2
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=2000)
    address = server.address().split("://", 1)[-1]
    rooms = {rid: Room(k) for rid in IDS}
    members: dict[tuple[str, int], Membership] = {}
    exported: dict[tuple[int, int], torch.Tensor] = {}  # (rank, first round) -> what A's rank sent
    loaded: dict[int, dict[str, Any]] = {}

    def start(rid: str, rank: int) -> None:
        config = ElasticConfig(lighthouse=address, replica_id=rid, join_timeout=30.0, outer_step_timeout=20.0)
        members[(rid, rank)] = Membership(config, ranks=ThreadRanks(rid, rank, rooms[rid]))

    def export(rank: int) -> dict[str, Any]:
        weights = torch.randn(5)
        exported[(rank, len(exported))] = weights
        return {"rank": rank, "weights": weights}

    def load(rank: int, state: dict[str, Any], heal: bool) -> int:
        loaded[rank] = state
        return state["membership"]["first_round"]

    def run_a(rank: int) -> None:
        m = members[("A", rank)]
        next_round = m.at_switch(0, lambda: export(rank), lambda s, h: load(rank, s, h))
        assert m.view.members == ("A",)
        started.wait(30)  # B's ranks are up: A switches until B is in
        for t in range(max(1, next_round), 60):
            m.at_switch(t, lambda: export(rank), lambda s, h: load(rank, s, h))
            if "B" in m.view.members:
                return
        raise AssertionError("B never joined")

    def run_b(rank: int) -> None:
        a_started.wait(30)
        start("B", rank)  # both of B's ranks are past it together (rank 0 shares its store's address)
        started.set()
        members[("B", rank)].at_switch(0, lambda: export(rank), lambda s, h: load(rank, s, h))

    started, a_started = threading.Event(), threading.Event()
    try:
        in_threads(lambda: start("A", 0), lambda: start("A", 1))
        a_started.set()
        in_threads(lambda: run_a(0), lambda: run_a(1), lambda: run_b(0), lambda: run_b(1))
        assert not hasattr(members[("A", 1)], "_client") and not hasattr(members[("B", 1)], "_client")
        assert hasattr(members[("A", 0)], "_client") and hasattr(members[("B", 0)], "_client")
        views = {key: (m.view.quorum_id, m.view.members, m.view.first_round) for key, m in members.items()}
        assert len(set(views.values())) == 1 and views[("B", 0)][1] == IDS, views
        for rank in range(k):  # rank i of B healed from A's rank i
            assert loaded[rank]["rank"] == rank and loaded[rank]["donor"] == "A"
            assert any(torch.equal(loaded[rank]["weights"], w) for (r, _), w in exported.items() if r == rank)
        received = {rank: torch.zeros(1) for rank in range(k)}

        def talk(rid: str, rank: int) -> None:
            pg = members[(rid, rank)].view.pg
            if rid == "A":
                pg.send([torch.tensor([100.0 + rank])], 1, 7).wait()
            else:
                pg.recv([received[rank]], 0, 7).wait()

        in_threads(*[lambda rid=rid, rank=rank: talk(rid, rank) for rid in IDS for rank in range(k)])
        assert [received[rank].item() for rank in range(k)] == [100.0, 101.0]
    finally:
        for m in members.values():
            m.close()
        server.shutdown()


# ---------------------------------------------------------------- the plan rank 0 hands on


def test_the_plan_is_read_once_by_each_rank_and_rank_zeros_failures_are_named():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))

    def client() -> Any:
        port = master.port  # noqa: F821  (master is deleted once the clients are gone)
        return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=30))

    ranks = [ThreadRanks("A", rank, Room(3)) for rank in range(3)]
    publish(master, 0, plan={"members": ("A", "B")})
    assert [read(client(), 0, r) for r in ranks[1:]] == [{"members": ("A", "B")}] * 2
    assert not master.check(["lightning_loco/elastic/replica/plan/0"])  # the last rank to read it cleared it
    publish(master, 1, error="RuntimeError: the Lighthouse at http://h:1 stopped")
    with pytest.raises(ReplicaRankError, match="Rank 0 of replica 'A' got no membership: RuntimeError: the Lig"):
        read(client(), 1, ranks[1])

    # rank 0 dies while rank 1 waits for its next plan: the wait fails at once, and says so
    reader, box = client(), {}

    def wait_for_plan() -> None:
        try:
            read(reader, 2, ranks[1])
        except ReplicaRankError as err:
            box["error"] = err

    thread = threading.Thread(target=wait_for_plan, daemon=True)
    thread.start()
    time.sleep(0.2)  # let it wait (if it has not started waiting yet, the closed store fails it all the same)
    del master
    thread.join(30)
    assert not thread.is_alive()
    message = str(box["error"])
    assert "while rank 1 was waiting for rank 0's membership" in message and "Restart all 3" in message, message
