"""The chunked all-reduce over real gloo processes: sums bitwise equal on every replica and to the float32 sum in
ascending replica order, for every stream count and staged payloads; chosen by payload size, or never with
all_reduce="backend"; its bytes counted as a ring all-reduce's. (The choice between it and gloo's own from the
first rounds' times: tests/test_all_reduce_choice.py.)"""

import os

import pytest
import torch
import torch.distributed as dist

from lightning_loco.testing.launch import free_port, init_gloo, start_ranks
from lightning_loco.transport import PendingSum, TorchDistributedTransport, sum_in_group_order
from lightning_loco.transport.base import RoundId
from lightning_loco.transport.chunked import MIN_BYTES
from lightning_loco.wire.codecs import ring_all_reduce_bytes

import tiny

SMALL = 1001  # uneven chunks for 3 and 4 replicas
LARGE = MIN_BYTES // 4 + 7  # just over the threshold, in float32 values


def _payload(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 10 ** (rank % 3)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=60)
    try:
        log = tiny.CallLog()
        log.install()
        one, two = (TorchDistributedTransport(torch.device("cpu"), streams=s) for s in (1, 2))
        staged = TorchDistributedTransport(torch.device("cpu"))
        staged.stage_cpu_payloads = True
        for t in (one, two, staged):
            t.chunked_min_bytes = 0  # every payload takes it
        res: dict = {"chosen": one.chunked_all_reduce}
        mine = _payload(rank, SMALL)
        log.active = True
        pending = one.start_all_reduce_sum(mine, round_id=RoundId(3, fragment=1))
        res["posted"] = log.take()
        res["pending"] = isinstance(pending, PendingSum)
        landed = pending.wait()
        res["gathered"] = log.take()
        res["one"], res["in_place"] = landed.clone(), landed is mine
        res["stats"] = (one.stats.bytes_sent, one.stats.bytes_received, one.stats.calls)
        log.active = False
        res["two"] = two.all_reduce_sum(_payload(rank, SMALL))
        res["staged"] = staged.all_reduce_sum(_payload(rank, SMALL))
        # the default threshold: a small payload keeps gloo's all-reduce, a large one takes the chunked one
        default = TorchDistributedTransport(torch.device("cpu"))
        log.active = True
        default.all_reduce_sum(_payload(rank, SMALL))
        res["small_calls"] = [c[0] for c in log.take()]
        res["large"] = default.all_reduce_sum(_payload(rank, LARGE))
        res["large_calls"] = [c[0] for c in log.take()]
        # all_reduce="backend": gloo's own all-reduce whatever the size
        backend = TorchDistributedTransport(torch.device("cpu"), all_reduce="backend")
        res["backend_chosen"] = backend.chunked_all_reduce or backend.pairwise_all_reduce
        res["backend"] = backend.all_reduce_sum(_payload(rank, LARGE))
        res["backend_calls"] = [c[0] for c in log.take()]
        log.active = False
        try:
            TorchDistributedTransport(torch.device("cpu"), all_reduce="ring")
        except ValueError as err:
            res["refused"] = str(err)
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 4])
def test_the_chunked_all_reduce_sums_in_replica_order_bitwise_on_every_replica(tmp_path, world):
    start_ranks(_worker, world, args=(world, free_port(), str(tmp_path)), timeout_s=180)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    expected = sum_in_group_order({r: _payload(r, SMALL) for r in range(world)}, range(world))
    large = sum_in_group_order({r: _payload(r, LARGE) for r in range(world)}, range(world))
    for r in range(world):
        peers = [j for j in range(world) if j != r]
        mine = torch.tensor_split(torch.empty(SMALL), world)[r].numel()
        sizes = [t.numel() for t in torch.tensor_split(torch.empty(SMALL), world)]
        assert res[r]["chosen"] and res[r]["pending"] and res[r]["in_place"]
        # posted: the reduce-scatter (receive my chunk from each peer, send each peer its chunk), all at once
        assert res[r]["posted"] == [("batch_isend_irecv", tuple([("irecv", j, mine) for j in peers]
                                                              + [("isend", j, sizes[j]) for j in peers]))]
        # waited: the all-gather (each peer's chunk into its place, mine to every peer)
        assert res[r]["gathered"] == [("batch_isend_irecv", tuple([("irecv", j, sizes[j]) for j in peers]
                                                                + [("isend", j, mine) for j in peers]))]
        for key in ("one", "two", "staged"):  # every replica, every stream count, staged or not: the same bits
            assert torch.equal(res[r][key], expected), key
        nbytes = ring_all_reduce_bytes(4 * SMALL, world)  # the stats count the ring's formula
        assert res[r]["stats"] == (nbytes, nbytes, 1)
        # what it sends: (N − 1)/N of the payload each way in each half, about the formula
        sent = sum(sizes[j] for j in peers) * 4 + len(peers) * mine * 4
        assert abs(sent - nbytes) <= 4 * world
        assert res[r]["small_calls"] == ["all_reduce"]
        assert res[r]["large_calls"] == ["batch_isend_irecv", "batch_isend_irecv"]
        assert torch.equal(res[r]["large"], large)
        assert not res[r]["backend_chosen"] and res[r]["backend_calls"] == ["all_reduce"]
        assert torch.allclose(res[r]["backend"], large, rtol=1e-5, atol=1e-4)  # gloo's order of the sum, not ours
        assert torch.equal(res[r]["backend"], res[0]["backend"])  # but the same bits on every replica
        assert "all_reduce must be one of ('auto', 'p2p', 'backend', 'backend_whole'), got 'ring'" in res[r]["refused"]


def _ranks_worker(rank: int, world: int, k: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=60)
    try:
        replica_groups = [dist.new_group(list(range(i * k, i * k + k))) for i in range(world // k)]
        slice_groups = [dist.new_group(list(range(j, world, k))) for j in range(k)]
        t = TorchDistributedTransport(torch.device("cpu"), ranks_per_replica=k, replica_group=replica_groups[rank // k],
                                      slice_group=slice_groups[rank % k])
        t.chunked_min_bytes = 0
        mine = _payload(t.replica, SMALL)  # the replica's payload, whole on each of its ranks
        res = {"chosen": t.chunked_all_reduce, "sum": t.all_reduce_sum(mine),
               "stats": (t.stats.bytes_sent, t.stats.bytes_received)}
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_chunked_all_reduce_with_replicas_of_two_ranks_moves_each_slice_and_gathers_the_sum(tmp_path):
    """3 replicas of 2 ranks (6 processes): each rank reduces its own slice of the replica's payload over the
    other replicas' ranks of the same slice, then the replica's ranks gather the whole sum; every rank ends
    with the float32 sum in ascending replica order, bitwise, and counts a ring's bytes for its slice."""
    world, k = 6, 2
    start_ranks(_ranks_worker, world, args=(world, k, free_port(), str(tmp_path)), timeout_s=240)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    replicas = world // k
    expected = sum_in_group_order({i: _payload(i, SMALL) for i in range(replicas)}, range(replicas))
    for r in range(world):
        assert res[r]["chosen"]
        assert torch.equal(res[r]["sum"], expected), r
        part = torch.tensor_split(torch.empty(SMALL), k)[r % k].numel()
        assert res[r]["stats"] == (ring_all_reduce_bytes(4 * part, replicas),) * 2, r
