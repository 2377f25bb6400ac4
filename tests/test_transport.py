"""The transport over real gloo processes (torch.distributed only, no Lightning)."""

import os

import pytest
import torch
import torch.distributed as dist

from lightning_loco.testing.launch import free_port, init_gloo, start_ranks
from lightning_loco.transport import (
    InProcessNetwork,
    Pending,
    PendingSum,
    TorchDistributedTransport,
    Transport,
    sum_in_group_order,
)
from lightning_loco.transport.in_process import InProcessPending, InProcessTransport

import tiny


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=30)
    try:
        t = TorchDistributedTransport(torch.device("cpu"))
        payload = torch.full((5,), float(rank + 1)) + torch.arange(5) * 1e-3 * rank
        results = {
            "pairs": t.group_sum(payload, (0, 2) if rank in (0, 2) else (1, 3)),
            "triple": t.group_sum(payload, (0, 1, 3)) if rank != 2 else t.group_sum(payload, (2,)),
            "stats": (t.stats.bytes_sent, t.stats.bytes_received, t.stats.calls),
            "all": t.all_reduce_sum(payload.clone()),
            "payload_after": payload,
            "alone_is_a_copy": t.group_sum(payload, (rank,)).data_ptr() != payload.data_ptr(),
        }
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_group_sum_and_all_reduce_across_four_processes(tmp_path):
    world = 4
    start_ranks(_worker, world, args=(world, free_port(), str(tmp_path)), start_method="spawn", timeout_s=240)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    payloads = [torch.full((5,), float(r + 1)) + torch.arange(5) * 1e-3 * r for r in range(world)]
    # pairs (0, 2) and (1, 3): both members hold bitwise the same sum
    assert torch.equal(res[0]["pairs"], res[2]["pairs"])
    assert torch.allclose(res[0]["pairs"], payloads[0] + payloads[2])
    assert torch.equal(res[1]["pairs"], res[3]["pairs"])
    # a group of three sums in ascending order on every member; a group of one talks to nobody
    expected = sum_in_group_order(dict(enumerate(payloads)), (0, 1, 3))
    for r in (0, 1, 3):
        assert torch.equal(res[r]["triple"], expected)
    assert torch.equal(res[2]["triple"], payloads[2])
    # payload bytes: one copy each way per peer (5 float32 = 20 bytes)
    assert res[0]["stats"] == (20 + 40, 20 + 40, 2)
    assert res[2]["stats"] == (20, 20, 1)
    for r in range(world):
        assert torch.allclose(res[r]["all"], sum(payloads))
        assert torch.equal(res[r]["payload_after"], payloads[r])  # group_sum does not modify its input
        assert res[r]["alone_is_a_copy"]  # even for a group of one: callers update the sum in place


def _streams_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=60)
    try:
        one = TorchDistributedTransport(torch.device("cpu"))
        three = TorchDistributedTransport(torch.device("cpu"), streams=3)  # every rank builds it: new_group
        payload = torch.randn(1001, generator=torch.Generator().manual_seed(rank))  # 1001: uneven pieces
        group = (0, 1, 2)
        results = {"one": one.group_sum(payload, group), "three": three.group_sum(payload, group),
                   "pair_one": one.group_sum(payload, (0, 1)) if rank < 2 else None,
                   "pair_three": three.group_sum(payload, (0, 1)) if rank < 2 else None,
                   "all_one": one.all_reduce_sum(payload.clone()), "all_three": three.all_reduce_sum(payload.clone()),
                   "bytes": (one.stats.bytes_sent, three.stats.bytes_sent), "groups": len(three.stream_groups)}
        refused = []
        for kwargs in ({"streams": 0}, {"streams": True}, {"streams": 2, "ranks_per_replica": 3,
                                                           "replica_group": object(), "slice_group": object()}):
            try:
                TorchDistributedTransport(torch.device("cpu"), **kwargs)
            except ValueError as err:
                refused.append(str(err))
        results["refused"] = refused
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_streams_spread_an_exchange_over_several_connections_with_the_same_sums(tmp_path):
    world = 3
    start_ranks(_streams_worker, world, args=(world, free_port(), str(tmp_path)), timeout_s=120)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for r in range(world):
        assert res[r]["groups"] == 3
        assert torch.equal(res[r]["three"], res[r]["one"])  # the pieces land in the same buffers: bitwise
        assert torch.allclose(res[r]["all_three"], res[r]["all_one"], atol=1e-6)  # gloo's order per piece
        assert torch.equal(res[r]["all_three"], res[0]["all_three"])  # every replica holds the same sum
        assert res[r]["bytes"][0] == res[r]["bytes"][1]  # the same payload bytes, over more connections
        assert len(res[r]["refused"]) == 3
        assert "streams must be an integer >= 1" in res[r]["refused"][0] and "got True" in res[r]["refused"][1]
        assert "needs replicas of one rank" in res[r]["refused"][2]
    for r in (0, 1):
        assert torch.equal(res[r]["pair_three"], res[r]["pair_one"])


def _two_replicas_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=60)
    try:
        log = tiny.CallLog()
        log.install()
        transport, streamed = (TorchDistributedTransport(torch.device("cpu"), streams=s) for s in (1, 2))
        payload = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
        gloo = payload.clone()
        dist.all_reduce(gloo)  # gloo's own all-reduce of the same buffers
        log.active = True
        mine = payload.clone()
        pending = transport.start_all_reduce_sum(mine)
        landed = pending.wait()
        calls = log.take()
        streamed_sum = streamed.all_reduce_sum(payload.clone())
        torch.save({"pairwise": transport.pairwise_all_reduce, "gloo": gloo, "sum": landed, "in_place": landed is mine,
                    "calls": calls, "bytes": transport.stats.bytes_sent, "streamed": streamed_sum},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_replicas_all_reduce_by_one_pair_exchange_with_gloos_sum(tmp_path):
    """Two replicas on gloo: an all-reduce is one pair exchange (one message each way, not gloo's pipelined
    chunks), the sum lands in the buffer and is bitwise gloo's own all-reduce's, with the same bytes; with
    streams too."""
    start_ranks(_two_replicas_worker, 2, args=(2, free_port(), str(tmp_path)), timeout_s=120)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for r in range(2):
        assert res[r]["pairwise"] and res[r]["in_place"]
        assert res[r]["calls"] == [("batch_isend_irecv", (("irecv", 1 - r, 1001), ("isend", 1 - r, 1001)))]
        assert torch.equal(res[r]["sum"], res[r]["gloo"]) and torch.equal(res[r]["sum"], res[0]["sum"])
        assert torch.equal(res[r]["streamed"], res[r]["gloo"])
        assert res[r]["bytes"] == 4 * 1001  # what a ring all-reduce of two sends: the buffer once


def test_every_transport_builds_on_the_shared_pending_and_transport():
    from lightning_loco.elastic.transport import ElasticPending, ElasticTransport

    for pending in (PendingSum, InProcessPending, ElasticPending):
        assert issubclass(pending, Pending)
    for transport in (TorchDistributedTransport, InProcessTransport, ElasticTransport):
        assert Transport in transport.__mro__  # (issubclass cannot check a protocol with attributes)
        assert transport.group_sum is Transport.group_sum and transport.all_reduce_sum is Transport.all_reduce_sum


def test_an_ordinary_in_process_exchange_is_not_alone_and_is_counted_once():
    network = InProcessNetwork(2)
    transports = [network.transport(i) for i in range(2)]
    payloads = [torch.full((3,), float(i + 1)) for i in range(2)]
    pendings = [t.start_group_sum(p, (0, 1)) for t, p in zip(transports, payloads)]
    assert all(isinstance(p, Pending) and not p.alone for p in pendings)
    assert pendings[0].completed_after() is not None  # both posted: complete without anyone waiting
    first = pendings[0].wait()
    assert torch.equal(first, payloads[0] + payloads[1]) and pendings[0].done() and not pendings[0].alone
    assert pendings[0].wait() is first  # the sum is kept; waiting again counts nothing more
    assert (transports[0].stats.bytes_sent, transports[0].stats.calls) == (12, 1)
    restored = transports[0].resolved(first, (1,))
    assert restored.done() and restored.wait() is first and not restored.alone
    assert transports[0].stats.calls == 1  # a restored exchange has nothing to count
    assert torch.equal(transports[1].group_sum(payloads[1], (1,)), payloads[1])  # the blocking form
