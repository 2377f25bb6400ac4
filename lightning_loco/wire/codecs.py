"""Wire formats of the outer step's payloads: pure tensor code, no network, no Lightning.

A :class:`Codec` turns a flat float32 buffer into one flat ``uint8`` buffer of exactly
``nbytes(n)`` bytes (what crosses the network) and back into float32:

* ``float32``: the identity. Strategies never call a codec for it: the payload travels as it is,
  bitwise today's path;
* ``bfloat16`` and ``float16``: a cast (2 bytes per value), rounded to nearest;
* ``int4`` and ``int2`` (:mod:`lightning_loco.wire.lowbit`): the same with 4-bit and 2-bit values
  packed into bytes; ``topk`` (:mod:`lightning_loco.wire.sparse`): the largest values of each chunk
  with their positions, for pseudo-gradients with error feedback;
* ``int8``: per-block absmax quantisation. Each block of ``block_size`` values gets one float32 scale
  s = max|x| / 127 and sends round(x / s) as int8, so every value comes back within s/2 = max|x|/254 of
  itself (float rounding aside). ``nbytes(n) = n + 4·⌈n / block_size⌉``. A block of zeros has s = 0
  and decodes to zeros (no division by zero); the last block may be shorter.

The encoded buffer is self-contained given n: float32 scales first, then the values.

Receivers accumulate in float32: every member of a group decodes every payload, its own included,
and sums the decoded buffers in ascending replica order, so all members hold bitwise the same sum
(:func:`decode_sum`). The all-reduce with a lossy codec (:func:`chunked_all_reduce`) never sums in
low precision: the buffer is cut into N chunks, replica c decodes and sums chunk c of every replica in
float32, encodes that sum once, and everyone decodes the same bytes. A codec that ``gathers`` (topk,
whose sums are not sparse) is not cut: every replica decodes and sums every replica's whole payload.

Bytes per replica, as every transport counts them: :func:`ring_all_reduce_bytes` for a float32
all-reduce (the nominal ring figure), :func:`all_reduce_bytes` for the chunked all-reduce of a codec.

Error feedback (:class:`WireFormat`, ``error_feedback``): for a payload that is a pseudo-gradient Δ
the sender keeps the residual e of what its codec lost and sends Q(Δ + e) instead of Q(Δ), then sets
e ← Δ + e − D(Q(Δ + e)). Nothing is lost for good, only delayed. With a decay β < 1 (``decay``, SparseLoCo's
error-feedback accumulator) it sends Q(Δ + β·e) and keeps e ← Δ + β·e − D(Q(Δ + β·e)): what waits longest counts
less, and the accumulator acts as a momentum of the pseudo-gradients (SparseLoCo runs it with no outer momentum).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_loco.wire import kernels as codec_kernels
from lightning_loco.wire.base import Codec
from lightning_loco.wire.lowbit import LOWBIT_FORMATS, LowBitBlockCodec
from lightning_loco.wire.sparse import (
    DEFAULT_CHUNK,
    DEFAULT_DENSITY,
    DEFAULT_MEAN,
    DEFAULT_VALUE_FORMAT,
    TopKCodec,
    check_density,
    kept,
)

FORMATS = ("float32", "bfloat16", "float16", "int8", "int4", "int2", "topk")  # the wire formats (``wire=``)
BLOCK_FORMATS = ("int8", "int4", "int2")  # the formats with a block size (values per scale)
DEFAULT_BLOCK_SIZE = 256
FLOAT16_MAX = 65504.0


class PayloadError(RuntimeError):
    """A payload that cannot be sent: NaN or inf, or values its wire format cannot carry."""


class Float32Codec(Codec):
    """The identity (4 bytes per value). Strategies skip it: float32 payloads travel as they are."""

    name = "float32"
    lossy = False

    def nbytes(self, n: int) -> int:
        return 4 * n

    def encode(self, x: Tensor) -> Tensor:
        return x.detach().to(torch.float32).contiguous().view(torch.uint8)

    def decode(self, data: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        values = data.view(torch.float32)[:n]
        return values.clone() if out is None else out.copy_(values)

    def decode_add_(self, total: Tensor, data: Tensor) -> Tensor:
        return total.add_(data.view(torch.float32)[: total.numel()])


class CastCodec(Codec):
    """bfloat16 or float16 on the wire: 2 bytes per value, round to nearest (even)."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"CastCodec takes torch.bfloat16 or torch.float16, got {dtype}")
        self.dtype = dtype
        self.name = "bfloat16" if dtype == torch.bfloat16 else "float16"

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, x: Tensor) -> Tensor:
        return x.detach().to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, data: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        values = data.view(self.dtype)[:n]
        return values.to(torch.float32) if out is None else out.copy_(values)

    def decode_add_(self, total: Tensor, data: Tensor) -> Tensor:
        codec_kernels.add_cast(total, data.view(self.dtype)[: total.numel()])
        return total

    def check(self, largest: float) -> str | None:
        if self.dtype == torch.float16:
            if largest > FLOAT16_MAX:
                return (f"it holds |x| = {largest:.4g}, beyond float16's largest value {FLOAT16_MAX:g}; use "
                        "wire_dtype='bfloat16' (float32's range) or compression='int8' (scaled per block)")
        return None


class Int8BlockCodec(Codec):
    """Per-block absmax int8: ``block_size`` values share one float32 scale max|x| / 127.

    Round trip error: at most max|x|/254 per value within its block (half a quantisation step), plus
    float32 rounding of the scale. Zeros stay exact zeros; a block of zeros decodes to zeros.
    """

    name = "int8"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"int8's block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size

    def blocks(self, n: int) -> int:
        return math.ceil(n / self.block_size)

    def nbytes(self, n: int) -> int:
        return n + 4 * self.blocks(n)

    def encode(self, x: Tensor) -> Tensor:
        x = x.detach().to(torch.float32).reshape(-1).contiguous()
        out = torch.empty(self.nbytes(x.numel()), dtype=torch.uint8, device=x.device)
        if x.numel():
            codec_kernels.int8_encode(x, self.block_size, out)
        return out

    def decode(self, data: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=data.device)
        if n:
            codec_kernels.int8_decode(data, n, self.block_size, out)
        return out

    def decode_add_(self, total: Tensor, data: Tensor) -> Tensor:
        if total.numel():
            codec_kernels.int8_decode(data, total.numel(), self.block_size, total, add=True)
        return total


def make_codec(format: str = "float32", block_size: int = DEFAULT_BLOCK_SIZE, density: float = DEFAULT_DENSITY,
               value_format: str = DEFAULT_VALUE_FORMAT, topk_mean: str = DEFAULT_MEAN) -> Codec:
    """The codec of a wire format (one of :data:`FORMATS`; ``block_size``: the values per scale of int8,
    int4 and int2; ``density``, ``value_format`` and ``topk_mean``: topk's share of each chunk sent, its values'
    format and how a group's payloads are averaged)."""
    if format not in FORMATS:
        raise ValueError(f"the wire format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")
    if format == "int8":
        return Int8BlockCodec(block_size)
    if format in LOWBIT_FORMATS:
        return LowBitBlockCodec(LOWBIT_FORMATS[format], block_size)
    if format == "topk":
        check_density(density)
        if value_format not in ("int8", "int4", "int2", "float16"):
            raise ValueError(f"topk's value_format must be 'int8', 'int4', 'int2' or 'float16', got {value_format!r}")
        values = make_codec(value_format, kept(density, DEFAULT_CHUNK))  # one scale per chunk
        return TopKCodec(values, density, DEFAULT_CHUNK, topk_mean)
    if format == "float32":
        return Float32Codec()
    return CastCodec(torch.bfloat16 if format == "bfloat16" else torch.float16)


def check_payload(x: Tensor, codec: Codec | None, who: str) -> None:
    """Raises :class:`PayloadError` naming ``who`` if ``x`` holds NaN or inf, or values ``codec``
    cannot carry. Reads ``x`` only, in two reductions that allocate nothing of its size (its min
    and max: NaN propagates through both, an infinity is one of them, and max|x| is the larger of
    max and −min); one host sync on an accelerator. Only a refused payload is read once more, to
    count its bad values."""
    if not x.numel():
        return
    lo, hi = codec_kernels.extremes(x)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int((~torch.isfinite(x)).sum())
        raise PayloadError(
            f"{who}: the outer step's payload holds {bad} NaN or infinite value(s) of {x.numel()}; nothing was sent. "
            "The inner steps diverged on this replica (lower the learning rate, clip gradients, or look for a bad "
            "batch); its peers are left untouched."
        )
    if codec is not None:
        reason = codec.check(max(hi, -lo))
        if reason is not None:
            raise PayloadError(f"{who}: the outer step's payload cannot be sent as {codec.name}: {reason}.")


# ------------------------------------------------------------------ layouts: slices and chunks


def segments(n: int, slices: int = 1, chunks: int = 1) -> list[tuple[int, int]]:
    """The (start, end) ranges that are encoded separately: ``slices`` parts as
    ``torch.tensor_split`` cuts them (one per rank of a replica), each cut into ``chunks`` parts
    (one per replica, for the all-reduce)."""
    out = []
    for start, end in _split(0, n, slices):
        out += _split(start, end, chunks)
    return out


def _split(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    n = end - start
    q, r = divmod(n, parts)
    bounds, pos = [], start
    for k in range(parts):
        size = q + (1 if k < r else 0)  # tensor_split's sizes: the first n mod parts get one more
        bounds.append((pos, pos + size))
        pos += size
    return bounds


def roundtrip_segments(x: Tensor, codec: Codec, parts: Sequence[tuple[int, int]]) -> Tensor:
    """D(Q(x)) encoding each segment on its own, as the transport does."""
    if not parts:
        return x.clone()
    out = torch.empty(sum(b - a for a, b in parts), dtype=torch.float32, device=x.device)
    at = 0
    for a, b in parts:  # each decoded straight into its place: no list of pieces to concatenate
        codec.decode(codec.encode(x[a:b]), b - a, out=out[at : at + b - a])
        at += b - a
    return out


def decode_sum(encoded: dict[int, Tensor], n: int, codec: Codec, group: Sequence[int]) -> Tensor:
    """Σ_j D(encoded_j) in float32, added in ascending replica order (identical on every member), as the
    codec delivers a sum (:meth:`~lightning_loco.wire.base.Codec.finish_sum_`)."""
    order = sorted(group)
    total = codec.decode(encoded[order[0]], n)
    for j in order[1:]:
        codec.decode_add_(total, encoded[j])
    return codec.finish_sum_(total, [encoded[j] for j in order])


def chunked_all_reduce(payloads: Sequence[Tensor], codec: Codec) -> Tensor:
    """The sum of every replica's payload as the lossy all-reduce computes it, in one place: chunk c
    (``torch.tensor_split`` into N) is decoded from every replica and summed in ascending order in
    float32, then encoded once and decoded by all. Reference for the transports (and the in-process
    transport's result)."""
    n = len(payloads)
    if codec.gathers:  # a sparse format: every replica's whole payload, decoded and summed by everyone
        return decode_sum({j: codec.encode(p) for j, p in enumerate(payloads)}, payloads[0].numel(), codec, range(n))
    chunked = [torch.tensor_split(p, n) for p in payloads]
    out = []
    for c in range(n):
        size = chunked[0][c].numel()
        encoded = {j: codec.encode(chunked[j][c]) for j in range(n)}
        reduced = decode_sum(encoded, size, codec, range(n))
        out.append(codec.roundtrip(reduced))
    return torch.cat(out)


def ring_all_reduce_bytes(nbytes: int, num_replicas: int) -> int:
    """Bytes each replica sends (and receives) in a ring all-reduce of a ``nbytes`` buffer over
    ``num_replicas``: 2(N − 1)/N copies, rounded down. gloo and NCCL pick their own algorithm, so this
    is the nominal figure every transport counts for a float32 all-reduce, not a measurement."""
    return 2 * (num_replicas - 1) * nbytes // num_replicas


def all_reduce_bytes(codec: Codec, numel: int, num_replicas: int, replica: int) -> int:
    """Bytes replica ``replica`` sends in the chunked all-reduce of ``numel`` values: chunk j of its
    payload to each replica j ≠ it, then its reduced chunk to each of the N − 1 others.
    About :func:`ring_all_reduce_bytes` of ``codec.nbytes(numel)``. A codec that ``gathers`` (sparse) sends
    its whole encoded payload to each of the N − 1 others: (N − 1)·nbytes(numel), growing with N."""
    if codec.gathers:
        return (num_replicas - 1) * codec.nbytes(numel)
    sizes = [b - a for a, b in _split(0, numel, num_replicas)]
    scatter = sum(codec.nbytes(s) for j, s in enumerate(sizes) if j != replica)
    return scatter + (num_replicas - 1) * codec.nbytes(sizes[replica])


# ------------------------------------------------------------------ what a driver needs


@dataclass(frozen=True)
class WireFormat:
    """How one run's payloads travel: the codec, and whether the sender keeps an error-feedback
    residual (see the module docstring)."""

    codec: Codec
    error_feedback: bool = False
    decay: float = 1.0  # β of the residual added to the next payload (1: plain error feedback)

    @property
    def lossy(self) -> bool:
        return self.codec.lossy
