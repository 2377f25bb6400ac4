"""The wire formats alone (pure tensor code): round-trip bounds, exact sizes, bad values, layouts."""

import math

import pytest
import torch

from lightning_loco.codecs import (
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
    wire_format,
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
    int8 = make_codec(compression="int8")  # default block size 256: a quarter plus 4 bytes per 256 values
    assert int8.nbytes(n) == n + 4 * math.ceil(n / 256)
    assert 0.25 < int8.nbytes(n) / (4 * n) < 0.254


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", [None, "bfloat16", "int8"])
def test_nan_and_inf_are_refused_naming_the_replica(bad, codec):
    x = payload(300)
    x[123] = bad
    c = None if codec is None else make_codec(codec) if codec != "int8" else make_codec(compression="int8")
    with pytest.raises(PayloadError, match=r"Replica 3, optimizer 0, outer step 7: .*1 NaN or infinite value\(s\) of 300"):
        check_payload(x, c, "Replica 3, optimizer 0, outer step 7")


def test_float16_refuses_values_beyond_its_range_and_bfloat16_carries_them():
    x = torch.tensor([1.0, -7.0e4, 2.0])
    with pytest.raises(PayloadError, match=r"Replica 1: .*float16.*7e\+04.*65504.*bfloat16"):
        check_payload(x, make_codec("float16"), "Replica 1")
    check_payload(x, make_codec("bfloat16"), "Replica 1")
    check_payload(x, make_codec(compression="int8"), "Replica 1")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"wire_dtype": "fp8"}, r"wire_dtype must be one of 'float32', 'bfloat16', 'float16', got 'fp8'"),
        ({"wire_dtype": torch.bfloat16}, "wire_dtype must be one of"),
        ({"compression": "int4"}, r"compression must be None \(the default\) or 'int8', got 'int4'"),
        ({"compression": "int8", "block_size": 0}, r"compression_block_size must be an integer >= 1, got 0.*256"),
        ({"compression": "int8", "block_size": 2.5}, "compression_block_size must be an integer >= 1, got 2.5"),
        ({"compression": "int8", "block_size": True}, "compression_block_size must be an integer >= 1, got True"),
        ({"block_size": -1}, "compression_block_size"),
        ({"wire_dtype": "bfloat16", "compression": "int8"}, "leave wire_dtype at 'float32'"),
        ({"error_feedback": "yes"}, "error_feedback must be None"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wire_format(**kwargs)


def test_error_feedback_defaults_to_pseudo_gradients_and_lossy_codecs():
    assert wire_format("bfloat16", pseudo_gradient=True).error_feedback
    assert not wire_format("bfloat16", pseudo_gradient=False).error_feedback
    assert wire_format(compression="int8", error_feedback=True).error_feedback
    assert not wire_format("float32", error_feedback=True).error_feedback  # nothing is lost: nothing to feed back


@pytest.mark.parametrize("n,slices,chunks", [(10, 1, 1), (10, 1, 3), (11, 2, 4), (3, 1, 4), (1001, 3, 7)])
def test_segments_cut_as_tensor_split(n, slices, chunks):
    x = torch.arange(n)
    expected = [c for s in torch.tensor_split(x, slices) for c in torch.tensor_split(s, chunks)]
    got = [x[a:b] for a, b in segments(n, slices, chunks)]
    assert [t.tolist() for t in got] == [t.tolist() for t in expected]


@pytest.mark.parametrize("codec", [make_codec("bfloat16"), make_codec(compression="int8", block_size=16)])
def test_the_chunked_all_reduce_sums_decoded_chunks_in_float32(codec):
    n, size = 4, 1001
    xs = [payload(size, seed=s) for s in range(n)]
    total = chunked_all_reduce(xs, codec)
    # its pieces: every replica's chunk decoded and summed in order, then encoded once more
    parts = segments(size, 1, n)
    for c, (a, b) in enumerate(parts):
        decoded = decode_sum({j: codec.encode(x[a:b]) for j, x in enumerate(xs)}, b - a, codec, range(n))
        assert torch.equal(total[a:b], codec.roundtrip(decoded))
    # and so within the two quantisations of the float32 sum
    first = sum((roundtrip_segments(x, codec, parts) - x).abs() for x in xs)
    exact = sum(xs)
    second = (total - sum(roundtrip_segments(x, codec, parts) for x in xs)).abs()
    assert torch.all((total - exact).abs() <= first + second + 1e-6)
    assert (total - exact).abs().max() < 0.05 * exact.abs().max()


def test_all_reduce_bytes_are_two_n_minus_one_over_n_of_the_codec():
    codec = make_codec(compression="int8")
    numel = 1_000_000
    for n in (2, 4, 8):
        sent = [all_reduce_bytes(codec, numel, n, r) for r in range(n)]
        nominal = 2 * (n - 1) / n * codec.nbytes(numel)
        assert all(abs(s - nominal) / nominal < 1e-3 for s in sent), (n, sent, nominal)
    bf16 = make_codec("bfloat16")
    assert all_reduce_bytes(bf16, 12, 4, 0) == 3 * 2 * 3 + 3 * 2 * 3  # chunks of 3 values, 2 bytes each
