"""The wire formats alone (pure tensor code): round-trip bounds, exact sizes, bad values, layouts."""

import math

import pytest
import torch

from lightning_loco.replica.options import WireConfig
from lightning_loco.wire.codecs import (
    CastCodec,
    Int8BlockCodec,
    PayloadError,
    all_reduce_bytes,
    check_payload,
    chunked_all_reduce,
    decode_sum,
    make_codec,
    roundtrip_segments,
    segments,
)

SIZES = (1, 7, 255, 256, 257, 1000)


def payload(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # values over six orders of magnitude, with exact zeros, as weights and pseudo-gradients have
    x = torch.randn(n, generator=g) * torch.logspace(-4, 1, n)[torch.randperm(n, generator=g)]
    x[:: 5] = 0.0
    return x


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 8), (torch.float16, 11)])
def test_casts_round_to_nearest_within_half_a_unit(n, dtype, bits):
    codec, x = CastCodec(dtype), payload(n)
    encoded = codec.encode(x)
    assert encoded.dtype == torch.uint8 and encoded.numel() == codec.nbytes(n) == 2 * n
    y = codec.decode(encoded, n)
    assert y.dtype == torch.float32
    # relative error at most 2^-(mantissa bits + 1); float16's subnormals below 2^-14 round to 2^-25
    bound = x.abs() * 2.0**-bits + (2.0**-25 if dtype == torch.float16 else 0.0)
    assert torch.all((y - x).abs() <= bound)
    assert torch.equal(y[x == 0], x[x == 0])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [1, 7, 256])
def test_int8_error_is_at_most_half_a_step_of_its_block(n, block):
    codec, x = Int8BlockCodec(block), payload(n, seed=n)
    encoded = codec.encode(x)
    assert encoded.numel() == codec.nbytes(n) == n + 4 * math.ceil(n / block)
    y = codec.decode(encoded, n)
    for start in range(0, n, block):
        part, back = x[start : start + block], y[start : start + block]
        step = part.abs().max() / 127
        assert torch.all((back - part).abs() <= step / 2 * (1 + 1e-5) + 1e-30), start
    assert torch.equal(y[x == 0], x[x == 0])  # zeros stay exact zeros
    if block == 1:
        assert torch.allclose(y, x, rtol=1e-6, atol=0)  # one value per scale: exact up to the scale's rounding


def test_int8_blocks_of_zeros_and_a_short_last_block():
    codec = Int8BlockCodec(4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 0.0, 3.0])  # a zero block, a full one, one of 1
    y = codec.roundtrip(x)
    assert torch.equal(y[:4], torch.zeros(4))  # no division by zero: the zero block's scale is 0
    assert torch.all(torch.isfinite(y))
    assert y[8] == 3.0  # a block of one value is its own absmax: exact
    assert codec.nbytes(9) == 9 + 4 * 3
    assert codec.roundtrip(torch.zeros(0)).numel() == 0
    assert torch.equal(codec.roundtrip(torch.zeros(9)), torch.zeros(9))


def test_sizes_against_float32():
    n = 1_000_000
    assert make_codec("bfloat16").nbytes(n) / (4 * n) == 0.5
    assert make_codec("float16").nbytes(n) / (4 * n) == 0.5
    assert make_codec("float32").nbytes(n) == 4 * n
    int8 = make_codec("int8")  # default block size 256: a quarter plus 4 bytes per 256 values
    assert int8.nbytes(n) == n + 4 * math.ceil(n / 256)
    assert 0.25 < int8.nbytes(n) / (4 * n) < 0.254


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", [None, "bfloat16", "int8"])
def test_nan_and_inf_are_refused_naming_the_replica(bad, codec):
    x = payload(300)
    x[123] = bad
    c = None if codec is None else make_codec(codec)
    with pytest.raises(PayloadError,
                       match=r"Replica 3, optimizer 0, outer step 7: .*1 NaN or infinite value\(s\) of 300"):
        check_payload(x, c, "Replica 3, optimizer 0, outer step 7")


def test_float16_refuses_values_beyond_its_range_and_bfloat16_carries_them():
    x = torch.tensor([1.0, -7.0e4, 2.0])
    with pytest.raises(PayloadError, match=r"Replica 1: .*float16.*7e\+04.*65504.*bfloat16"):
        check_payload(x, make_codec("float16"), "Replica 1")
    check_payload(x, make_codec("bfloat16"), "Replica 1")
    check_payload(x, make_codec("int8"), "Replica 1")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"format": "fp8"},
         r"wire format must be one of 'float32', 'bfloat16', 'float16', 'int8', 'int4', 'int2', 'topk', got 'fp8'"),
        ({"format": torch.bfloat16}, "wire format must be one of"),
        ({"format": "int8", "block_size": 0}, r"wire block_size must be an integer >= 1, got 0.*256"),
        ({"format": "int8", "block_size": 2.5}, "wire block_size must be an integer >= 1, got 2.5"),
        ({"format": "int8", "block_size": True}, "wire block_size must be an integer >= 1, got True"),
        ({"block_size": -1}, "wire block_size"),
        ({"error_feedback": "yes"}, "wire error_feedback must be True or False"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WireConfig(**kwargs).check()


def test_error_feedback_defaults_to_pseudo_gradients_and_lossy_codecs():
    assert WireConfig("bfloat16").resolve(pseudo_gradient=True).error_feedback
    assert not WireConfig("bfloat16").resolve(pseudo_gradient=False).error_feedback
    assert WireConfig("int8", error_feedback=True).resolve(pseudo_gradient=False).error_feedback
    assert not WireConfig("int8", error_feedback=False).resolve(pseudo_gradient=True).error_feedback
    # float32 beside error_feedback is refused when the options are built (the rule error-feedback-lossy-only);
    # resolved alone it feeds nothing back: nothing is lost
    assert not WireConfig("float32", error_feedback=True).resolve(pseudo_gradient=True).error_feedback


@pytest.mark.parametrize("n,slices,chunks", [(10, 1, 1), (10, 1, 3), (11, 2, 4), (3, 1, 4), (1001, 3, 7)])
def test_segments_cut_as_tensor_split(n, slices, chunks):
    x = torch.arange(n)
    expected = [c for s in torch.tensor_split(x, slices) for c in torch.tensor_split(s, chunks)]
    got = [x[a:b] for a, b in segments(n, slices, chunks)]
    assert [t.tolist() for t in got] == [t.tolist() for t in expected]


@pytest.mark.parametrize("codec", [make_codec("bfloat16"), make_codec("int8", 16)])
def test_the_chunked_all_reduce_sums_decoded_chunks_in_float32(codec):
    n, size = 4, 1001
    xs = [payload(size, seed=s) for s in range(n)]
    total = chunked_all_reduce(xs, codec)
    # its pieces: every replica's chunk decoded and summed in order, then encoded once more
    parts = segments(size, 1, n)
    for a, b in parts:
        decoded = decode_sum({j: codec.encode(x[a:b]) for j, x in enumerate(xs)}, b - a, codec, range(n))
        assert torch.equal(total[a:b], codec.roundtrip(decoded))
    # and so within the two quantisations of the float32 sum
    first = sum((roundtrip_segments(x, codec, parts) - x).abs() for x in xs)
    exact = sum(xs)
    second = (total - sum(roundtrip_segments(x, codec, parts) for x in xs)).abs()
    assert torch.all((total - exact).abs() <= first + second + 1e-6)
    assert (total - exact).abs().max() < 0.05 * exact.abs().max()


def test_all_reduce_bytes_are_two_n_minus_one_over_n_of_the_codec():
    codec = make_codec("int8")
    numel = 1_000_000
    for n in (2, 4, 8):
        sent = [all_reduce_bytes(codec, numel, n, r) for r in range(n)]
        nominal = 2 * (n - 1) / n * codec.nbytes(numel)
        assert all(abs(s - nominal) / nominal < 1e-3 for s in sent), (n, sent, nominal)
    bf16 = make_codec("bfloat16")
    assert all_reduce_bytes(bf16, 12, 4, 0) == 3 * 2 * 3 + 3 * 2 * 3  # chunks of 3 values, 2 bytes each


# ---------------------------------------------------------------------------- the fast path against the definition


class Reference:
    """The codecs as first written: one whole-buffer tensor operation after another (absolute values,
    a zero-padded copy, division, rounding, clamping, the cast). The fast path must give these bytes."""

    @staticmethod
    def int8_encode(x: torch.Tensor, b: int) -> torch.Tensor:
        x = x.detach().to(torch.float32).reshape(-1)
        n = x.numel()
        blocks = math.ceil(n / b)
        out = torch.empty(n + 4 * blocks, dtype=torch.uint8)
        if n == 0:
            return out
        padded = x.new_zeros(blocks * b)
        padded[:n] = x
        rows = padded.reshape(blocks, b)
        scales = rows.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        out[: 4 * blocks] = scales.view(torch.uint8)
        out[4 * blocks :] = q.view(torch.uint8)
        return out

    @staticmethod
    def int8_decode(data: torch.Tensor, n: int, b: int) -> torch.Tensor:
        if n == 0:
            return torch.empty(0)
        blocks = math.ceil(n / b)
        scales = data[: 4 * blocks].view(torch.float32)
        q = data[4 * blocks : 4 * blocks + n].view(torch.int8).to(torch.float32)
        q = torch.cat([q, q.new_zeros(blocks * b - n)])
        return (q.reshape(blocks, b) * scales[:, None]).reshape(-1)[:n]


def hard_payload(n: int, b: int, seed: int = 0) -> torch.Tensor:
    """Random values with what a codec must get right: blocks of zeros (and of −0.0), subnormals
    (alone and beside normal values), values near float32's largest, ties for the rounding."""
    g = torch.Generator().manual_seed(seed)
    x = payload(n, seed)
    for k, start in enumerate(range(0, n, b)):
        block = x[start : start + b]
        kind = k % 7
        if kind == 1:
            block.zero_()
        elif kind == 2:
            block.fill_(-0.0)
        elif kind == 3:
            block.mul_(1e-39)  # every value subnormal: the scale is subnormal or zero, the clamp bites
        elif kind == 4:
            block[::3] *= 1e-40
        elif kind == 5:
            block.copy_((torch.rand(block.numel(), generator=g) * 2 - 1) * 3.4e38)  # near float32's largest
        elif kind == 6:  # exact multiples of half a step: round half to even decides
            block.copy_(torch.randint(-254, 255, (block.numel(),), generator=g) / 2.0)
    assert torch.isfinite(x).all()
    return x


@pytest.fixture(params=["pieces", "whole"])
def pieces(request, monkeypatch):
    """Both ways the kernels walk a payload: in pieces, here of a few blocks (a CPU with torch on
    one thread), and in one piece (several threads, or an accelerator)."""
    from lightning_loco.wire import kernels as codec_kernels
    threads = torch.get_num_threads()
    if request.param == "pieces":
        torch.set_num_threads(1)
        monkeypatch.setattr(codec_kernels, "PIECE_BYTES", 4 * 1000)
        assert codec_kernels.piece_values(torch.device("cpu"), 10_000, 7) == 994
    else:
        torch.set_num_threads(max(2, threads))
        assert codec_kernels.piece_values(torch.device("cpu"), 10_000, 7) == 10_000
    yield request.param
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [0, 1, 5, 255, 256, 257, 4000, 10_007])
@pytest.mark.parametrize("block", [1, 7, 256, 1000])
def test_int8_is_bitwise_the_reference(n, block, pieces):
    codec = Int8BlockCodec(block)
    for seed in range(2):
        x = hard_payload(n, block, seed)
        encoded = codec.encode(x)
        assert torch.equal(encoded, Reference.int8_encode(x, block)), (n, block, seed)
        decoded = codec.decode(encoded, n)
        assert decoded.dtype == torch.float32 and torch.equal(decoded, Reference.int8_decode(encoded, n, block))
        into = torch.full((n,), float("nan"))
        assert codec.decode(encoded, n, out=into) is into and torch.equal(into, decoded)
        total = payload(n, seed + 9)
        expected = total.clone().add_(decoded)
        assert codec.decode_add_(total, encoded) is total and torch.equal(total, expected)


def test_int8_encodes_views_and_other_dtypes_as_their_float32_copy(pieces):
    codec = Int8BlockCodec(16)
    x = hard_payload(3000, 16)
    strided = x.view(1000, 3).t()  # not contiguous
    assert torch.equal(codec.encode(strided), Reference.int8_encode(strided.contiguous(), 16))
    assert torch.equal(codec.encode(x[5:2005]), Reference.int8_encode(x[5:2005].clone(), 16))  # an offset view
    half = x.clamp(-6e4, 6e4).to(torch.float16)
    assert torch.equal(codec.encode(half), Reference.int8_encode(half.float(), 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casts_decode_into_and_add_bitwise(dtype, pieces):
    codec, n = CastCodec(dtype), 10_007
    x = hard_payload(n, 256).clamp(-6e4, 6e4)
    encoded = codec.encode(x)
    assert torch.equal(encoded, x.to(dtype).view(torch.uint8))
    decoded = codec.decode(encoded, n)
    assert torch.equal(decoded, encoded.view(dtype).float())
    into = torch.empty(n)
    assert codec.decode(encoded, n, out=into) is into and torch.equal(into, decoded)
    total = payload(n, 3)
    expected = total.clone().add_(decoded)
    assert torch.equal(codec.decode_add_(total, encoded), expected)


@pytest.mark.parametrize(
    "codec", [make_codec("float32"), make_codec("float16"), make_codec("int8", 64)]
)
def test_decode_sum_and_segments_equal_decoding_each_payload(codec, pieces):
    n = 5000
    xs = [hard_payload(n, 64, seed=s).clamp(-6e4, 6e4) for s in range(3)]
    encoded = {j: codec.encode(x) for j, x in enumerate(xs)}
    expected = codec.decode(encoded[0], n)
    for j in (1, 2):
        expected = expected + codec.decode(encoded[j], n)
    assert torch.equal(decode_sum(encoded, n, codec, [2, 0, 1]), expected)
    parts = segments(n, 2, 3)
    assert torch.equal(roundtrip_segments(xs[0], codec, parts),
                       torch.cat([codec.roundtrip(xs[0][a:b]) for a, b in parts]))
    reversed_parts = parts[::-1]  # any parts, concatenated in the order given
    assert torch.equal(roundtrip_segments(xs[0], codec, reversed_parts),
                       torch.cat([codec.roundtrip(xs[0][a:b]) for a, b in reversed_parts]))


@pytest.mark.parametrize("positions", [[0], [299], [64, 65, 66], [255, 256], list(range(0, 300, 7))])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_every_nan_or_inf_is_found_and_counted(positions, bad):
    """Wherever they are (first, last, across vector lanes and blocks, many): the message counts them."""
    x = payload(300)
    x[positions] = bad
    for codec in (None, make_codec("float16"), make_codec("int8")):
        refused = rf"^W: .* holds {len(positions)} NaN or infinite value\(s\) of 300; nothing was sent"
        with pytest.raises(PayloadError, match=refused):
            check_payload(x, codec, "W")
    x[positions[0]] = -bad if bad == bad else bad  # an inf of either sign beside NaN: still counted
    with pytest.raises(PayloadError, match=rf"holds {len(positions)} NaN"):
        check_payload(x, None, "W")


@pytest.mark.parametrize("position", [0, 17, 500_000, 1_000_002])
def test_nan_and_inf_are_found_in_a_large_payload(position):
    """The reductions run vectorised and in parallel on a large payload: a single bad value anywhere counts."""
    x = payload(1_000_003)
    check_payload(x, make_codec("float16"), "W")
    for bad in (float("nan"), float("-inf")):
        x[position] = bad
        with pytest.raises(PayloadError, match=r"holds 1 NaN or infinite value\(s\) of 1000003"):
            check_payload(x, None, "W")


def test_the_float16_range_check_names_the_largest_value():
    check_payload(torch.tensor([65504.0, -65504.0]), make_codec("float16"), "R")  # float16's largest: carried
    for values, largest in (([1.0, 65504.5], "6.55e\\+04"), ([-7.0e4, 2.0], "7e\\+04"), ([-1e6, 7e4], "1e\\+06")):
        refused = rf"^R: .*as float16: it holds \|x\| = {largest}, beyond float16's largest value 65504"
        with pytest.raises(PayloadError, match=refused):
            check_payload(torch.tensor(values), make_codec("float16"), "R")
    check_payload(torch.zeros(0), make_codec("float16"), "R")  # nothing to send, nothing to refuse
    check_payload(torch.full((5,), 3e38), make_codec("bfloat16"), "R")
