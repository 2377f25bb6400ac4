"""The sub-byte and sparse wire formats (int4, int2, topk): their codecs, and the same runs as the other lossy
formats (tests/test_compression.py): the driver against the reference bitwise, the bytes counted against the
codec's formula, exact resume with a residual in flight, and forked gloo processes."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from test_codecs import hard_payload, pieces  # noqa: F401  (pieces: a fixture)

from lightning_loco import DiLoCoStrategy
from lightning_loco.replica.options import WireConfig
from lightning_loco.testing.launch import init_gloo, start_ranks
from lightning_loco.transport import TorchDistributedTransport
from lightning_loco.wire import kernels, sparse
from lightning_loco.wire.codecs import all_reduce_bytes, chunked_all_reduce, decode_sum, make_codec
from lightning_loco.wire.lowbit import LowBitBlockCodec
from lightning_loco.wire.sparse import TopKCodec

import tiny
from oracle import ReplicaSimulator
from test_driver import ALGORITHMS, assert_same, lockstep, replicas_for, roundtrip, threaded, trace

WIRES = {
    "int4": WireConfig("int4", block_size=4),  # small blocks: several per tiny model
    "int2": WireConfig("int2", block_size=4),
    "topk": WireConfig("topk", density=0.3, value_format="int4", topk_mean="replicas", error_feedback_decay=1.0),
    "topk_senders": WireConfig("topk", density=0.3, value_format="int4"),  # SparseLoCo's: senders, decay 0.95
}


# ---------------------------------------------------------------------------- the codecs


@pytest.mark.parametrize("bits,top", [(4, 7.0), (2, 1.5)])
@pytest.mark.parametrize("block", [1, 3, 64, 256])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 255, 1000, 4099])
def test_lowbit_sizes_and_every_value_within_half_a_step(bits, top, block, n):
    codec = make_codec(f"int{bits}", block)
    assert isinstance(codec, LowBitBlockCodec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    encoded = codec.encode(x)
    assert encoded.dtype == torch.uint8 and encoded.numel() == codec.nbytes(n)
    assert codec.nbytes(n) == 4 * math.ceil(n / block) + math.ceil(n * bits / 8)
    y = codec.decode(encoded, n)
    blocks = math.ceil(n / block)
    padded = torch.cat([x, x.new_zeros(blocks * block - n)]).view(blocks, block)
    scale = (padded.abs().amax(1) / top).repeat_interleave(block)[:n]
    assert ((y - x).abs() <= scale / 2 * (1 + 1e-6)).all()  # within half a step of the block's scale
    out = torch.full((n,), 7.0)
    assert codec.decode(encoded, n, out=out) is out and torch.equal(out, y)
    total = torch.ones(n)
    assert torch.equal(codec.decode_add_(total, encoded), torch.ones(n) + y)


def test_lowbit_levels_and_zero_blocks():
    x = torch.tensor([0.0, 7.0, -7.0, 3.4, 0.0, 0.0, 0.0, 0.0, 1.5, -1.5, 0.2, -0.7])
    assert torch.equal(make_codec("int4", 4).roundtrip(x)[:8], torch.tensor([0.0, 7, -7, 3, 0, 0, 0, 0]))
    int2 = make_codec("int2", 4).roundtrip(x)  # levels ±0.5 s, ±1.5 s with s = max|x| / 1.5
    assert torch.equal(int2[4:], torch.tensor([0.0, 0, 0, 0, 1.5, -1.5, 0.5, -0.5]))
    assert int2[0] == 7.0 / 3  # a zero beside non-zeros comes back as s / 2


@pytest.mark.parametrize("value_format", ["int8", "int4", "int2", "float16"])
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 4097, 3 * 4096 + 100])
def test_topk_keeps_the_largest_of_each_chunk(value_format, n):
    codec = make_codec("topk", density=0.02, value_format=value_format)
    assert isinstance(codec, TopKCodec) and codec.gathers
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    encoded = codec.encode(x)
    assert encoded.numel() == codec.nbytes(n)
    chunks = [min(4096, n - a) for a in range(0, n, 4096)]
    kept = [min(c, max(1, math.ceil(0.02 * c))) for c in chunks]
    m = sum(kept)
    value_bytes = {"int8": m + 4 * len(chunks), "int4": 4 * len(chunks) + math.ceil(m / 2),
                   "int2": 4 * len(chunks) + math.ceil(m / 4), "float16": 2 * m}[value_format] if n else 0
    assert codec.nbytes(n) == value_bytes + (value_bytes & 1) + 2 * m
    y = codec.decode(encoded, n)
    for a, k in zip(range(0, n, 4096), kept):
        chunk, got = x[a : a + 4096], y[a : a + 4096]
        chosen = torch.topk(chunk.abs(), k).indices
        sent = torch.zeros_like(chunk, dtype=torch.bool)
        sent[chosen] = True
        assert (got[~sent] == 0).all()  # the rest decodes to zeros
        if value_format == "float16":
            assert torch.equal(got[sent], chunk[sent].half().float())
        else:  # one scale per chunk: within half a step
            top = {"int8": 127.0, "int4": 7.0, "int2": 1.5}[value_format]
            assert ((got[sent] - chunk[sent]).abs() <= chunk.abs().max() / top / 2 * (1 + 1e-6)).all()


@pytest.mark.usefixtures("pieces")
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("block", [1, 3, 7, 256, 1000])
@pytest.mark.parametrize("n", [1, 2, 5, 255, 257, 4000, 10_007])
def test_lowbit_pieces_are_bitwise_the_whole_buffer(bits, block, n):
    """The kernels (pieces of whole blocks and bytes, a table of codes per byte) against the whole-buffer
    formulation, on sizes that are multiples of neither the piece, the block nor the byte."""
    codec, blocks = make_codec(f"int{bits}", block), math.ceil(n / block)
    for seed in range(2):
        x = hard_payload(n, block, seed)
        expected = torch.zeros(codec.nbytes(n), dtype=torch.uint8)
        scales, packed = expected[: 4 * blocks].view(torch.float32), expected[4 * blocks :]
        kernels.lowbit_encode_whole(x, bits, block, scales, packed)
        assert torch.equal(codec.encode(x), expected), (n, block, seed)
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, (codec.nbytes(n),), dtype=torch.uint8, generator=g)
        data[: 4 * blocks].view(torch.float32).copy_(torch.randn(blocks) * 10.0 ** (seed * 30 - 20))  # any byte
        for encoded in (expected, data):
            whole = torch.full((n,), float("nan"))
            scales, packed = encoded[: 4 * blocks].view(torch.float32), encoded[4 * blocks :]
            kernels.lowbit_decode_whole(scales, packed, n, bits, block, whole)
            assert torch.equal(codec.decode(encoded, n).view(torch.int32), whole.view(torch.int32)), (n, block, seed)


def _rows(kind: str, r: int, c: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(r * c)
    x = torch.randn(r, c, generator=g)
    if kind == "ties":  # few distinct values: the k-th largest is tied across the cut
        x = (x * 4).round_() / 4
    elif kind == "bfloat16":
        x = x.bfloat16().float()
    elif kind == "mixed":  # a row of zeros, a sorted row, a NaN, an infinity, -0.0, a heavy tail, subnormals
        x = x ** 3
        x[0] = 0.0
        x[1 % r] = torch.linspace(-1, 1, c)
        x[2 % r, c // 2] = float("nan")
        x[3 % r, 0] = float("inf")
        x[4 % r] = -0.0
        x[5 % r] *= 1e-42
    return x


@pytest.fixture(params=[4 * 1000, None])
def one_thread(request, monkeypatch):
    """torch on one thread (where topk selects by candidates), in pieces of a few rows or of 4 MiB."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if request.param:
        monkeypatch.setattr(kernels, "PIECE_BYTES", request.param)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", ["gaussian", "ties", "bfloat16", "mixed"])
@pytest.mark.parametrize("r,c,k", [(40, 4096, 82), (9, 4096, 4096), (33, 100, 3), (12, 64, 2), (7, 37, 5),
                                   (20, 512, 16), (5, 8, 4)])
def test_topk_selection_is_bitwise_torch_topk(kind, r, c, k, monkeypatch):
    """The top-k by group maxima and candidates (pieces of rows) against torch.topk of every row:
    the same positions, in the same order, and the same values; Gaussian rows need no row-wise topk.
    (With several threads, or on an accelerator, the selection is torch.topk's: test_topk_keeps_the_largest.)"""
    rows = _rows(kind, r, c)
    expected = torch.empty(r, k, dtype=torch.int64), torch.empty(r, k)
    sparse._top(rows, k, *expected)
    got = torch.full((r, k), -1, dtype=torch.int64), torch.full((r, k), 7.0)
    whole_rows = []
    top = sparse._top
    monkeypatch.setattr(sparse, "_top", lambda x, *rest: whole_rows.append(x.shape[0]) or top(x, *rest))
    sparse._select(rows, k, *got)
    if kind == "gaussian" and (c, k) == (4096, 82):
        assert whole_rows == []
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1].view(torch.int32), expected[1].view(torch.int32))


def test_topk_refuses_bad_arguments_and_float16_range():
    with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
        make_codec("topk", density=0.0)
    with pytest.raises(ValueError, match="value_format must be"):
        make_codec("topk", value_format="bfloat16")
    assert make_codec("topk", value_format="float16").check(1e5) is not None
    assert make_codec("topk", value_format="int2").check(1e30) is None


def test_a_sparse_all_reduce_is_every_payload_summed_in_replica_order():
    codec = make_codec("topk", density=0.05, topk_mean="replicas")
    xs = [torch.randn(5000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    expected = codec.decode(codec.encode(xs[0]), 5000)
    for x in xs[1:]:
        expected += codec.decode(codec.encode(x), 5000)
    assert torch.equal(chunked_all_reduce(xs, codec), expected)
    for n_rep in (2, 3, 8):  # bytes per replica grow with N
        assert all_reduce_bytes(codec, 5000, n_rep, 0) == (n_rep - 1) * codec.nbytes(5000)


def test_topk_senders_mean_averages_each_position_over_the_replicas_that_sent_it():
    """SparseLoCo's aggregation: a position's sum × N / (replicas that sent it), so that the algorithm's division
    by N gives the mean over its senders; positions nobody sent stay 0. The senders come from torch.topk here."""
    chunk, n, num = sparse.DEFAULT_CHUNK, 2 * sparse.DEFAULT_CHUNK + 100, 3
    codec = make_codec("topk", density=0.01, value_format="float16", topk_mean="senders")
    plain = make_codec("topk", density=0.01, value_format="float16", topk_mean="replicas")
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(num)]
    xs[1][:chunk] = xs[0][:chunk]  # replicas 0 and 1 send the same positions of the first chunk
    counts = torch.zeros(n)
    for x in xs:
        for start in range(0, n, chunk):
            piece = x[start : start + chunk]
            k = sparse.kept(0.01, piece.numel())
            counts[start + torch.topk(piece.abs(), k).indices] += 1
    total = chunked_all_reduce(xs, plain)
    expected = total * num / counts.clamp(min=1)
    got = chunked_all_reduce(xs, codec)
    assert torch.equal(got, expected)
    assert ((counts == 0) == (got == 0)).all() and (counts == 2).any() and (counts == 1).any()
    one = counts == 1  # a position only one replica sent: N × its value, where "replicas" gives its value
    assert torch.equal(got[one], total[one] * num)
    assert repr(codec).endswith("mean='senders')")
    with pytest.raises(ValueError, match="topk's mean must be one of"):
        TopKCodec(make_codec("int2", 41), 0.01, chunk, "median")


@pytest.mark.parametrize("n", [0, 1, 5, 16, 32, 37, 48, 50])
def test_topk_positions_and_senders_mean_for_short_exact_and_empty_chunks(n):
    """Chunks of 16 values: n smaller than a chunk, exact multiples, a short last chunk, nothing at all. The
    positions are each chunk's top k in the whole buffer, and the senders' mean is N × sum / count."""
    chunk, density, num = 16, 0.25, 3
    codec = TopKCodec(make_codec("float16"), density, chunk, "senders")
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(7 + i)) for i in range(num)]
    counts, total = torch.zeros(n), torch.zeros(n)
    for x in xs:
        encoded = codec.encode(x)
        chosen = [start + int(j) for start in range(0, n, chunk)
                  for j in torch.topk(x[start : start + chunk].abs(), sparse.kept(density, min(chunk, n - start)))[1]]
        assert sorted(codec.positions(encoded, n).tolist()) == sorted(chosen)
        counts[chosen] += 1
        total += codec.decode(encoded, n)
    got = decode_sum({i: codec.encode(x) for i, x in enumerate(xs)}, n, codec, range(num))
    assert torch.equal(got, total * num / counts.clamp(min=1))


# ---------------------------------------------------------------------------- runs over the in-process transport


CASES = [("int4", a) for a in ("noloco", "diloco", "gasloc_random_pairs", "gasloc_complete")] + \
        [("int2", a) for a in ("noloco", "diloco")] + [("topk", "diloco"), ("topk_senders", "diloco")]


@pytest.mark.parametrize("wire,name", CASES)
def test_rounds_equal_the_codec_reference_bitwise(wire, name):
    n, H, rounds = 4, 3, 4
    fmt = WIRES[wire].resolve(ALGORITHMS[name]().payload_is_pseudo_gradient)
    _, replicas = replicas_for(ALGORITHMS[name], n, H, wire=WIRES[wire])
    threaded(replicas, rounds * H)
    sim = ReplicaSimulator(ALGORITHMS[name](), [replicas[0].initial[0]] * n, replicas[0].flats[0].shapes, wire=fmt)
    numel = replicas[0].flats[0].numel
    for t in range(rounds):
        new = sim.step([r.logs[0].starts[t] for r in replicas])
        for i, r in enumerate(replicas):
            assert_same(r.logs[0].landings[t].after, new[i], f"weights of replica {i}, round {t}")
            report = r.driver.reports[t]
            expected = (all_reduce_bytes(fmt.codec, numel, n, i) if sim.algorithm.collective
                        else fmt.codec.nbytes(numel) * len(report.peers))
            assert report.bytes_sent == expected  # the transport counts the codec's formula
    if name == "diloco":
        for r in replicas[1:]:
            assert_same(r.flats[0].gather(), replicas[0].flats[0].gather())
    assert all((r.driver.slots[0].residual is not None) == fmt.error_feedback for r in replicas)


def residual_of(replica) -> torch.Tensor:
    residual = replica.driver.slots[0].residual
    return torch.zeros(0) if residual is None else residual.clone()


@pytest.mark.parametrize("wire", ["int4", "int2", "topk"])
def test_diloco_resumes_with_a_residual_and_a_round_in_flight_bitwise(wire):
    n, H, tau = 3, 4, 2
    total, cut = 4 * H + tau, 2 * H + 1
    kwargs = {"overlap_steps": tau, "wire": WIRES[wire]}
    _, whole = replicas_for(ALGORITHMS["diloco"], n, H, **kwargs)
    expected = []
    for _ in range(total):
        lockstep(whole, 1)
        expected.append(trace(whole) + [residual_of(r) for r in whole])
    _, first = replicas_for(ALGORITHMS["diloco"], n, H, **kwargs)
    lockstep(first, cut)
    saved = [roundtrip(r.driver.state_dict()) for r in first]
    assert all(s[0]["in_flight"] is not None and s[0]["residual"].abs().max() > 0 for s in saved)
    weights = [r.flats[0].gather() for r in first]
    _, resumed = replicas_for(ALGORITHMS["diloco"], n, H, weights=[[w] for w in weights], **kwargs)
    for r, s in zip(resumed, saved):
        r.driver.load_state_dict(s)
    for step in range(cut, total):
        lockstep(resumed, 1)
        for i, (w, a) in enumerate(trace(resumed)):
            assert_same(w, expected[step][i][0], f"weights of replica {i} after step {step + 1}")
            assert_same(a, expected[step][i][1], f"anchor of replica {i} after step {step + 1}")
            assert_same(residual_of(resumed[i]), expected[step][n + i], f"residual of replica {i}")


def test_the_strategies_build_the_new_formats():
    wire = DiLoCoStrategy(wire=WireConfig("topk", density=0.01, value_format="int8"), outer_lr=1.0,
                          outer_momentum=0.0).options.wire_format
    assert isinstance(wire.codec, TopKCodec) and wire.error_feedback
    assert wire.codec.density == 0.01 and wire.codec.value_format == "int8"
    assert wire.codec.mean == "senders" and wire.decay == 0.95  # SparseLoCo's aggregation and accumulator
    assert DiLoCoStrategy(wire="int2").options.wire_format.codec.name == "int2"


# ---------------------------------------------------------------------------- torch.distributed, forked gloo

FORMATS = {"int4": make_codec("int4", 5), "int2": make_codec("int2", 5),
           "topk": make_codec("topk", density=0.02, value_format="int2", topk_mean="replicas"),
           "topk_senders": make_codec("topk", density=0.02, value_format="int2", topk_mean="senders")}
SIZE = 9001  # three chunks of topk, the last short


def _payload(replica: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(20 + replica))


def _gloo_worker(rank: int, world: int, out_dir: str) -> None:
    # a FileStore, not a port (no race for a free port among parallel tests); the timeout only bounds a failure
    init_gloo(rank, world, file=os.path.join(out_dir, "store"), timeout_s=120)
    try:
        t = TorchDistributedTransport(torch.device("cpu"))
        results = {}
        for name, codec in FORMATS.items():
            before = t.stats.bytes_sent
            group = (0, 1) if t.replica in (0, 1) else ()
            summed = t.group_sum(_payload(t.replica), group, codec=codec) if group else None
            between = t.stats.bytes_sent
            reduced = t.all_reduce_sum(_payload(t.replica), codec=codec)
            results[name] = {"group": summed, "all": reduced, "group_bytes": between - before,
                             "all_bytes": t.stats.bytes_sent - between}
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gloo_sums_and_bytes_of_the_new_formats(tmp_path):
    """3 processes: every replica holds bitwise the reference's sums, and counts the codec's bytes."""
    world = 3
    start_ranks(_gloo_worker, world, args=(world, str(tmp_path)), start_method="spawn", timeout_s=240)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    xs = [_payload(i) for i in range(world)]
    for name, codec in FORMATS.items():
        pair = decode_sum({j: codec.encode(xs[j]) for j in (0, 1)}, SIZE, codec, (0, 1))
        reduced = chunked_all_reduce(xs, codec)
        for rank in range(world):
            if rank in (0, 1):
                assert torch.equal(res[rank][name]["group"], pair), (name, rank)
                assert res[rank][name]["group_bytes"] == codec.nbytes(SIZE)
            assert torch.equal(res[rank][name]["all"], reduced), (name, rank)
            assert res[rank][name]["all_bytes"] == all_reduce_bytes(codec, SIZE, world, rank), (name, rank)


@pytest.mark.slow
@pytest.mark.parametrize("wire", [{"format": "int4", "block_size": 16}, {"format": "int2", "block_size": 16},
                                  {"format": "topk", "density": 0.3, "value_format": "int2"}],
                         ids=lambda w: w["format"])
def test_diloco_strategy_with_the_new_formats_over_three_processes(tmp_path, wire):
    """Lightning end to end, 3 replicas: bitwise the same weights after every outer step, the codec's bytes."""
    h, steps = 4, 8
    outer = {"outer_lr": 1.0, "outer_momentum": 0.0} if wire["format"] == "topk" else {}  # SparseLoCo's form
    recs = tiny.launch(tmp_path, strategy="diloco", devices=3, max_steps=steps,
                       strategy_kwargs={"sync_every": h, "wire": wire, **outer})
    numel = recs[0]["weights"][0].numel()
    codec = WireConfig(**wire).resolve(True).codec
    for step in range(steps):
        same = all(torch.equal(recs[0]["weights"][step], rec["weights"][step]) for rec in recs[1:])
        assert same == ((step + 1) % h == 0), step
    for rec in recs:
        assert [r["bytes_sent"] for r in rec["reports"]] == [all_reduce_bytes(codec, numel, 3, rec["rank"])] * 2
