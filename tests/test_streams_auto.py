"""``streams="auto"``, the default: how many connections an exchange takes from its size and, for pair exchanges, from
what each pair measured (``pair_streams``), where it is one stream, that the rules accept it everywhere, and that the
sums are bitwise those of one stream for every count (real gloo processes)."""

import dataclasses
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_loco import ElasticConfig, WireConfig
from lightning_loco.algorithms import DiLoCo
from lightning_loco.replica.options import Options
from lightning_loco.replica.run import stream_count
from lightning_loco.simulator import TrainingSimulator
from lightning_loco.testing.launch import free_port, init_gloo, start_ranks, strategy_class
from lightning_loco.transport import TorchDistributedTransport, sum_in_group_order
from lightning_loco.transport import streams as streams_module
from lightning_loco.transport.pair_streams import AUTO_COUNT, ONE, PairStreams, encode
from lightning_loco.transport.streams import AUTO_BYTES_PER_STREAM, AUTO_MAX_STREAMS, auto_stream_groups, auto_streams

import tiny

MB = 1 << 20


def test_auto_cuts_a_message_into_one_piece_per_4_mb_between_1_and_8():
    assert AUTO_BYTES_PER_STREAM == 4 * MB and AUTO_MAX_STREAMS == 8
    assert [auto_streams(n) for n in (0, 4, 480_000, 8 * MB - 1, 8 * MB, 40 * MB, 200 * MB)] == [1, 1, 1, 1, 2, 8, 8]
    assert auto_streams(200 * MB, most=3) == 3  # never more than the groups there are
    # groups: by the model's bytes on gloo; one on NCCL and with replicas of several ranks
    assert [auto_stream_groups(n, "gloo", 1) for n in (480_000, 12 * MB, 200 * MB)] == [1, 3, 8]
    assert auto_stream_groups(200 * MB, "nccl", 1) == 1 and auto_stream_groups(200 * MB, "gloo", 2) == 1


def test_the_wire_defaults_to_auto_and_takes_it_or_an_integer():
    assert WireConfig().streams == "auto"
    WireConfig(streams="auto").check()
    WireConfig(streams=3).check()
    for bad in (0, 2.0, "many", True):
        with pytest.raises(ValueError, match="wire streams must be an integer >= 1"):
            WireConfig(streams=bad).check()


def test_auto_needs_no_stream_groups_where_streams_cannot_work(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    base = Options(algorithm=DiLoCo(), sync_every=4)
    assert base.wire.streams == "auto"
    big = 200 * MB
    assert stream_count(base, "gloo", big) == ("auto", 8)
    assert stream_count(base, "gloo", 12 * MB) == ("auto", 3)
    assert stream_count(base, "gloo", 480_000) == (1, 1)  # a small model makes no group
    assert stream_count(base, "nccl", big) == (1, 1)
    several = dataclasses.replace(base, ranks_per_replica=2)
    assert stream_count(several, "gloo", big) == (1, 1)
    factory = dataclasses.replace(base, transport_factory=lambda **kw: None)
    assert stream_count(factory, "gloo", big) == (1, 1)
    elastic = dataclasses.replace(base, elastic=ElasticConfig("localhost:29510", replica_id="x"))
    assert stream_count(elastic, "gloo", big) == (1, 1)
    fixed = dataclasses.replace(base, wire=WireConfig(streams=4))
    assert stream_count(fixed, "gloo", 4) == (4, 4)  # an integer is taken as given
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert stream_count(several, "gloo", big) == (1, 1)  # one replica of two ranks: nobody to exchange with


def test_the_rules_accept_auto_where_they_refuse_an_integer():
    noloco = strategy_class("noloco")
    for kwargs in ({"ranks_per_replica": 2}, {"transport_factory": lambda **kw: None},
                   {"elastic": ElasticConfig("localhost:29510", replica_id="x")}):
        noloco(wire=WireConfig(streams="auto"), **kwargs)
        noloco(**kwargs)
        with pytest.raises(ValueError, match="wire.streams=4"):
            noloco(wire=WireConfig(streams=4), **kwargs)
    TrainingSimulator(tiny.TinyRegressor(), [[], []], DiLoCo(), sync_every=2, wire=WireConfig(streams="auto"))


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=60)
    try:
        streams_module.AUTO_BYTES_PER_STREAM = 1024  # small payloads cut as large ones would be
        transports = {s: TorchDistributedTransport(torch.device("cpu"), streams=s) for s in (1, 2, 3, "auto")}
        log = tiny.CallLog()
        log.install()
        res: dict = {"groups": len(transports["auto"].stream_groups)}
        for s, t in transports.items():
            t.chunked_min_bytes = 0
            payload = torch.randn(1001, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
            log.active = s == "auto"
            res[s] = {"triple": t.group_sum(payload, (0, 1, 2)),
                      "pair": t.group_sum(payload, (0, 1)) if rank < 2 else None,
                      "all": t.all_reduce_sum(payload.clone()),
                      "small": t.group_sum(payload[:200], (0, 1, 2)),
                      "bytes": t.stats.bytes_sent}
            log.active = False
        res["calls"] = log.take()
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_stream_count_and_auto_give_the_sums_of_one_stream_bitwise(tmp_path):
    world = 3
    start_ranks(_worker, world, args=(world, free_port(), str(tmp_path)), timeout_s=180)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    payloads = {r: torch.randn(1001, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(world)}
    expected = sum_in_group_order(payloads, range(world))
    for r in range(world):
        assert res[r]["groups"] == AUTO_MAX_STREAMS  # "auto" alone on gloo: the most groups
        for s in (1, 2, 3, "auto"):
            assert torch.equal(res[r][s]["triple"], expected), s
            assert torch.equal(res[r][s]["all"], expected), s  # the chunked all-reduce, every count
            assert torch.equal(res[r][s]["small"], expected[:200]), s
            assert res[r][s]["bytes"] == res[r][1]["bytes"], s  # the same payload bytes over more connections
            if r < 2:
                assert torch.equal(res[r][s]["pair"], payloads[0] + payloads[1]), s
        # "auto": 4004 bytes in 3 pieces (one per 1024 bytes), the all-reduce's chunks of ~1336 bytes whole,
        # the 800-byte message whole
        sizes = [len(call[1]) and call[1][0][2] for call in res[r]["calls"]]
        counts = [c[0] for c in res[r]["calls"]]
        assert set(counts) == {"batch_isend_irecv"}
        pair = 1 if r < 2 else 0
        # the triple: each replica's proposal to its peers (one number), then three pieces; the pair, the same
        # payload's second exchange: both proposed one connection in the triple, so one message each way
        assert len(sizes) == 4 + 2 * pair + 1 + 1 + 1, sizes
        assert sizes[:4] == [1, 334, 334, 333]  # the triple's three pieces (tensor_split of 1001)
        if pair:
            assert sizes[4:6] == [1, 1001]


def test_a_large_exchange_on_small_send_buffers_warns_once_with_the_setting(tmp_path, monkeypatch):
    from lightning_loco.transport import sockets

    small, large = tmp_path / "small", tmp_path / "large"
    small.write_text("4096\t16384\t4194304\n")
    large.write_text("4096 16384 33554432\n")
    assert sockets.host_max_send_buffer(str(small)) == 4 * MB and sockets.host_max_send_buffer(str(large)) == 32 * MB
    assert sockets.host_max_send_buffer(str(tmp_path / "none")) is None
    monkeypatch.setattr(sockets, "_state", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not sockets.check_send_buffer(sockets.LARGE_BYTES - 1, str(small))  # small exchange: nothing read
        assert "limit" not in sockets._state
        assert not sockets.check_send_buffer(sockets.LARGE_BYTES, str(large))  # 32 MB buffers: fine
    monkeypatch.setattr(sockets, "_state", {})
    with pytest.warns(sockets.SendBufferWarning, match="net.ipv4.tcp_wmem='4096 16384 33554432'"):
        assert sockets.check_send_buffer(200 * MB, str(small))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not sockets.check_send_buffer(200 * MB, str(small))  # once per process


def _exchange(pairs: dict[int, PairStreams], peers: dict[int, int], times: dict[int, float], by_size: int = 8
              ) -> dict[int, int]:
    """One round of pair exchanges between in-process PairStreams, as the transport drives them: each side's
    count for its peer, proposals posted, then landed with the given times. Returns each replica's count."""
    counts = {i: pairs[i].count(j, by_size) for i, j in peers.items()}
    for i, j in peers.items():
        assert counts[i] == counts[j]  # both sides cut their messages alike
    now = {i: pairs[i].taken([counts[i]]) for i in peers}
    proposed = {i: pairs[i].proposal(now[i]) for i in peers}
    numbers = {i: pairs[i].posted(now[i], [], proposed[i], {j: encode(proposed[j])}) for i, j in peers.items()}
    for i in peers:
        pairs[i].landed(now[i], times[counts[i]])
        pairs[i].settle(through=numbers[i])
    return counts


def test_a_pair_tries_each_count_twice_then_takes_one_connection_only_where_both_found_it_faster():
    # a link where one connection is faster (10 s against 12 s): trials by size, one, size, one, then one
    pairs = {0: PairStreams(), 1: PairStreams()}
    counts = [_exchange(pairs, {0: 1, 1: 0}, {1: 10.0, 8: 12.0})[0] for _ in range(7)]
    assert counts == [8, 1, 8, 1, 1, 1, 1]
    assert pairs[0].seconds == {ONE: [10.0] * 5, AUTO_COUNT: [12.0] * 2} and pairs[0].pending == {ONE: 0, AUTO_COUNT: 0}
    # a long fat pipe, where the size's count is 4.5 x faster: one round at one connection is enough (its time is
    # known when the third round proposes), then the size's count
    pairs = {0: PairStreams(), 1: PairStreams()}
    assert [_exchange(pairs, {0: 1, 1: 0}, {1: 9.0, 8: 2.0})[0] for _ in range(6)] == [8, 1, 8, 8, 8, 8]
    assert pairs[0].seconds[ONE] == [9.0]
    # a difference under 1.5 x takes both trials of each: 2.9 s against 2.0 s
    pairs = {0: PairStreams(), 1: PairStreams()}
    assert [_exchange(pairs, {0: 1, 1: 0}, {1: 2.9, 8: 2.0})[0] for _ in range(6)] == [8, 1, 8, 1, 8, 8]
    # where the two sides disagree (one found one connection faster, the other not), the size's count
    pairs = {0: PairStreams(), 1: PairStreams()}
    for _ in range(4):
        _exchange(pairs, {0: 1, 1: 0}, {1: 10.0, 8: 12.0})
    pairs[1].seconds[AUTO_COUNT].append(1.0)
    assert [_exchange(pairs, {0: 1, 1: 0}, {1: 10.0, 8: 12.0})[0] for _ in range(3)] == [1, 8, 8]


def test_each_pair_decides_from_its_own_last_meeting_and_a_first_meeting_takes_the_size():
    pairs = {i: PairStreams() for i in range(4)}
    times = {1: 10.0, 8: 12.0}
    meetings = [{0: 1, 1: 0, 2: 3, 3: 2}, {0: 2, 2: 0, 1: 3, 3: 1}] * 4
    seen = [_exchange(pairs, m, times) for m in meetings]
    assert seen[0] == seen[1] == {i: 8 for i in range(4)}  # every pair's first meeting: by size
    assert seen[-1] == {i: 1 for i in range(4)}  # each pair settled on one connection
    assert set(pairs[0].met) == {1, 2} and pairs[0].met[1] == (ONE, ONE)
    # an exchange whose peers took different counts keeps no time
    assert PairStreams().taken([1, 8]) is None and PairStreams().taken([8, 8]) == AUTO_COUNT
    with pytest.raises(ValueError, match="trials must be >= 1"):
        PairStreams(trials=0)


class _Prefers(PairStreams):
    def __init__(self, choice: str) -> None:
        super().__init__()
        self.choice = choice

    def preferred(self) -> str:
        return self.choice

    def clear(self) -> bool:  # loopback's times of a few KB: every trial taken, whatever they say
        return False


def _learning_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=60)
    try:
        streams_module.AUTO_BYTES_PER_STREAM = 1024  # 4004 bytes: three pieces by size
        t = TorchDistributedTransport(torch.device("cpu"), streams="auto")
        # both replicas find one connection faster (1001 floats); only replica 0 does (1002 floats)
        t.pair_streams[(0, 0, 1001)] = _Prefers(ONE)
        t.pair_streams[(0, 0, 1002)] = _Prefers(ONE if rank == 0 else AUTO_COUNT)
        log = tiny.CallLog()
        log.install()
        log.active = True

        def pieces() -> list[tuple[int, int]]:  # (peer, numel) of each payload piece this rank sent
            return [(op[1], op[2]) for c in log.take() for op in c[1] if op[0] == "isend" and op[2] > 1]

        def payload(n: int, r: int, k: int) -> torch.Tensor:
            return torch.randn(n, generator=torch.Generator().manual_seed(100 * r + k))

        res: dict = {}
        if rank < 2:
            for n in (1001, 1002):
                sums, cuts = [], []
                for r in range(7):
                    sums.append(t.group_sum(payload(n, r, rank), (0, 1)))
                    cuts.append(len(pieces()))
                res[n] = {"sums": sums, "pieces": cuts, "met": dict(t.pair_streams[(0, 0, n)].met)}
            # two exchanges posted before either is waited for, waited for in another order on each side: each
            # takes its count from the exchanges posted before it
            first = t.start_group_sum(payload(1001, 7, rank), (0, 1))
            second = t.start_group_sum(payload(1001, 8, rank), (0, 1))
            waited = [second.wait(), first.wait()] if rank == 0 else [first.wait(), second.wait()]
            res["out_of_order"] = {"sums": waited if rank == 1 else waited[::-1], "pieces": pieces()}
            # a fresh payload: replica 0 waits for its first exchange before it posts the second, replica 1 posts
            # the second first. The first took three pieces and both proposed one connection in it: the second
            # takes one on both sides (had replica 1 counted only the exchanges it waited for, it would cut three)
            a = t.start_group_sum(payload(1003, 10, rank), (0, 1))
            early = a.wait() if rank == 0 else None
            b = t.start_group_sum(payload(1003, 11, rank), (0, 1))
            res["posted_first"] = {"sums": [early if rank == 0 else a.wait(), b.wait()], "pieces": pieces()}
        # the three together with the payload the pair 0-1 settled on one connection for: replica 2 meets each of
        # them for the first time, so their messages take the size's three pieces, while 0 and 1 send each other one
        res["triple"] = t.group_sum(payload(1001, 9, rank), (0, 1, 2))
        res["triple_pieces"] = sorted(pieces())
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_three_processes_agree_on_each_exchange_s_count_and_sum_bitwise_alike(tmp_path):
    start_ranks(_learning_worker, 3, args=(3, free_port(), str(tmp_path)), timeout_s=180)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(3)]

    def payload(n: int, r: int, k: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(100 * r + k))

    for n, expected in ((1001, [3, 1, 3, 1, 1, 1, 1]), (1002, [3, 1, 3, 1, 3, 3, 3])):
        for r in range(2):
            assert res[r][n]["pieces"] == expected, (n, r)
            for i, got in enumerate(res[r][n]["sums"]):
                assert torch.equal(got, payload(n, i, 0) + payload(n, i, 1))  # bitwise, whatever the count
        assert res[0][n]["met"] == {1: res[1][n]["met"][0][::-1]}  # what each proposed, mirrored
    for r in range(2):
        first, second = res[r]["out_of_order"]["sums"]
        assert torch.equal(first, payload(1001, 7, 0) + payload(1001, 7, 1))
        assert torch.equal(second, payload(1001, 8, 0) + payload(1001, 8, 1))
        assert res[r]["out_of_order"]["pieces"] == [(1 - r, 1001)] * 2  # one connection, both
        assert res[r]["posted_first"]["pieces"] == [(1 - r, 335), (1 - r, 334), (1 - r, 334), (1 - r, 1003)]
        for k, got in zip((10, 11), res[r]["posted_first"]["sums"]):
            assert torch.equal(got, payload(1003, k, 0) + payload(1003, k, 1))
    total = payload(1001, 9, 0) + payload(1001, 9, 1) + payload(1001, 9, 2)
    for r in range(3):
        assert torch.equal(res[r]["triple"], total)
    assert res[0]["triple_pieces"] == [(1, 1001), (2, 333), (2, 334), (2, 334)]
    assert res[1]["triple_pieces"] == [(0, 1001), (2, 333), (2, 334), (2, 334)]
    assert res[2]["triple_pieces"] == [(0, 333), (0, 334), (0, 334), (1, 333), (1, 334), (1, 334)]
