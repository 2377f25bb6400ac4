"""The codecs' arithmetic at memory speed: every operation writes into a buffer it is given.

Written as one whole-buffer tensor operation after another (absolute values, a padded copy, the
division, rounding, clamping, the cast, the gathering of scales and values), an int8 encode
allocates about ten new buffers the size of the payload, streams each through main memory, and on
a CPU pays each one's page faults. Here nothing of the payload's size is allocated but the result
and one scratch buffer, and on a CPU running torch on one thread the payload is walked in pieces of
:data:`PIECE_BYTES`, small enough that a piece stays in the cache between the operations on it:
main memory sees the payload read once and the result written once. With several threads, and on
an accelerator, the whole buffer is one piece (see :func:`piece_values`).

Every function computes what the codecs' definitions say with the same tensor operations in the
same order (int4 and int2 decoding: exact integer steps to the same codes), so the encoded bytes and
the decoded floats are bitwise those of the whole-buffer formulation (``tests/test_codecs.py`` and
``tests/test_wire_lowbit.py`` hold them against it).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

PIECE_BYTES = 1 << 22  # float32 bytes of one piece on a single-threaded CPU: 4 MiB
LOWBIT_TOP = {4: 7.0, 2: 1.5}  # int4's and int2's largest level, in units of the block's scale
LOWBIT_OFFSET = {4: 8.0, 2: 1.5}  # the code of level v is v + offset (int2: floor(x / s) + 2)


def piece_values(device: torch.device, n: int, multiple: int = 1) -> int:
    """How many values one piece holds on ``device``: a multiple of ``multiple``, at least one.

    On a CPU where torch runs one thread, ``PIECE_BYTES``: a piece and its scratch stay in the
    last-level cache, and smaller pieces would pay more in the fixed cost of each operation (several
    µs) than they gain. Where torch runs several threads, every operation is a parallel region whose
    threads must all be scheduled before it ends; on a busy machine that wait outweighs the cache,
    so there, as on an accelerator, the whole buffer is one piece: as many operations as the
    naive formulation, without its temporaries (``benchmarks/codec_speed.py`` measured both)."""
    if device.type != "cpu" or torch.get_num_threads() > 1:
        return max(n, multiple)
    return max(1, PIECE_BYTES // 4 // multiple) * multiple


def extremes(x: Tensor) -> tuple[float, float]:
    """(min, max) of a non-empty ``x`` in two read-only reductions and one host sync. Both
    propagate NaN, and an infinity is one of them: they are finite exactly when every value is."""
    lo, hi = torch.stack([x.amin(), x.amax()]).tolist()
    return lo, hi


def int8_encode(x: Tensor, block_size: int, out: Tensor) -> None:
    """Per-block absmax int8 of the flat, contiguous float32 ``x`` into ``out`` (``uint8``, scales then values):
    s = max|x| / 127 per block, q = clamp(round(x / s'), −127, 127) with s' = s, or 1 where s = 0."""
    n, b = x.numel(), block_size
    blocks, full = -(-n // b), n // b
    scales = out[: 4 * blocks].view(torch.float32)
    q = out[4 * blocks : 4 * blocks + n].view(torch.int8)
    step = piece_values(x.device, full * b, b) // b
    work = torch.empty(min(full, step) * b, dtype=torch.float32, device=x.device)
    for start in range(0, full, step):
        stop = min(full, start + step)
        rows = x[start * b : stop * b].view(-1, b)
        _quantise(rows, scales[start:stop], work[: rows.numel()].view(-1, b), q[start * b : stop * b].view(-1, b))
    if full < blocks:  # the last, short block: the same operations on one row
        tail = x[full * b :].view(1, -1)
        _quantise(tail, scales[full:], torch.empty_like(tail), q[full * b :].view(1, -1))


def _quantise(rows: Tensor, scales: Tensor, work: Tensor, q: Tensor) -> None:
    """One piece of whole rows (blocks): their scales into ``scales``, their int8 values into ``q``;
    ``work`` is float32 scratch of the rows' shape."""
    torch.amax(torch.abs(rows, out=work), dim=1, out=scales)
    scales.div_(127.0)
    safe = torch.where(scales > 0, scales, 1.0)  # a zero block: 0 / 1 = 0
    torch.div(rows, safe[:, None], out=work)
    q.copy_(work.round_().clamp_(-127, 127))


def int8_decode(data: Tensor, n: int, block_size: int, out: Tensor, add: bool = False) -> None:
    """The float32 values q·s of ``n`` int8-encoded values into ``out``, or added to it (``add``)."""
    b = block_size
    blocks, full = -(-n // b), n // b
    scales = data[: 4 * blocks].view(torch.float32)
    q = data[4 * blocks : 4 * blocks + n].view(torch.int8)
    step = piece_values(out.device, full * b, b) // b
    work = torch.empty(min(full, step) * b if add else 0, dtype=torch.float32, device=out.device)
    for start in range(0, full, step):
        stop = min(full, start + step)
        target = out[start * b : stop * b]
        piece = work[: target.numel()] if add else target
        piece.copy_(q[start * b : stop * b]).view(-1, b).mul_(scales[start:stop, None])
        if add:
            target.add_(piece)
    if full < blocks:
        target = out[full * b :]
        piece = torch.empty_like(target) if add else target
        piece.copy_(q[full * b :]).view(1, -1).mul_(scales[full:, None])
        if add:
            target.add_(piece)


def add_cast(total: Tensor, values: Tensor) -> None:
    """``total += values.float()`` for 2-byte floats, a piece at a time (:func:`piece_values`): the
    float32 copy of ``values`` the mixed-dtype addition may make is one piece's, not the payload's."""
    n = total.numel()
    step = piece_values(total.device, n)
    for start in range(0, n, step):
        total[start : start + step].add_(values[start : start + step])


def lowbit_encode(x: Tensor, bits: int, block_size: int, out: Tensor) -> None:
    """Per-block absmax int4 or int2 (:mod:`lightning_loco.wire.lowbit`) of the flat, contiguous float32 ``x``
    into ``out`` (``uint8``, the scales then the packed codes).

    The pieces are whole blocks holding whole bytes (a multiple of lcm(block, 8 / bits) values): each
    piece's scales and bytes are those of the whole buffer. What is left after the last such piece, less
    than one multiple, goes through :func:`lowbit_encode_whole`: its padding codes are the whole buffer's."""
    n, b, per = x.numel(), block_size, 8 // bits
    blocks = -(-n // b)
    scales, packed = out[: 4 * blocks].view(torch.float32), out[4 * blocks :]
    unit = math.lcm(b, per)
    main = n // unit * unit
    step = piece_values(x.device, main, unit)
    work = torch.empty(min(main, step), dtype=torch.float32, device=x.device)
    codes = torch.empty(min(main, step), dtype=torch.uint8, device=x.device)
    for start in range(0, main, step):
        stop = min(main, start + step)
        rows = x[start:stop].view(-1, b)
        w = work[: stop - start].view(-1, b)
        s = scales[start // b : stop // b]
        torch.amax(torch.abs(rows, out=w), dim=1, out=s)
        s.div_(LOWBIT_TOP[bits])
        safe = torch.where(s > 0, s, 1.0)  # a zero block: 0 / 1 = 0
        torch.div(rows, safe[:, None], out=w)
        _codes(w, bits)
        c = codes[: stop - start]
        c.copy_(w.view(-1))
        _pack(c.view(-1, per), packed[start // per : stop // per], bits)
    if main < n:
        lowbit_encode_whole(x[main:], bits, b, scales[main // b :], packed[main // per :])


def _codes(y: Tensor, bits: int) -> Tensor:
    """The codes, as float32, of the values in units of their block's scale (in place)."""
    if bits == 4:
        return y.round_().clamp_(-7, 7).add_(8)
    return y.floor_().clamp_(-2, 1).add_(2)


def _pack(codes: Tensor, packed: Tensor, bits: int) -> None:
    """Each row of ``codes`` (``uint8``, 8 / bits per row, the first in the lowest bits) into one byte:
    the codes' bits do not overlap, so their sum is their bitwise or."""
    torch.add(codes[:, 0], codes[:, 1], alpha=1 << bits, out=packed)
    for i in range(2, codes.shape[1]):
        packed.add_(codes[:, i], alpha=1 << (i * bits))


def lowbit_encode_whole(x: Tensor, bits: int, block_size: int, scales: Tensor, packed: Tensor) -> None:
    """:func:`lowbit_encode` as one whole-buffer operation after another on a padded copy: the definition,
    used for a buffer's last values and, in the tests, to hold the pieces against."""
    n, b, per = x.numel(), block_size, 8 // bits
    blocks = -(-n // b)
    pad = blocks * b - n
    rows = (torch.cat([x, x.new_zeros(pad)]) if pad else x).view(blocks, b)
    torch.amax(rows.abs(), dim=1, out=scales)
    scales.div_(LOWBIT_TOP[bits])
    safe = torch.where(scales > 0, scales, 1.0)  # a zero block: 0 / 1 = 0
    flat = _codes(rows / safe[:, None], bits).view(-1).to(torch.uint8)
    size = -(-n // per)
    spare = size * per - flat.numel()  # the last byte's codes past the padded blocks are zeros
    if spare > 0:
        flat = torch.cat([flat, flat.new_zeros(spare)])
    grouped = flat[: size * per].view(-1, per)
    packed.copy_(grouped[:, 0])
    for i in range(1, per):
        packed.bitwise_or_(grouped[:, i].bitwise_left_shift(i * bits))


def lowbit_decode(data: Tensor, n: int, bits: int, block_size: int, out: Tensor) -> None:
    """The float32 values (code − offset)·s of ``n`` int4- or int2-encoded values into ``out``.

    Each byte widens to a little-endian lane of 8 / bits bytes (int16 or int32) in which shifted, or-ed and
    masked copies of it leave one code per byte, in order: the lanes, read as bytes, are the codes, cast
    to float32 into ``out`` in one operation (no strided writes). Then, as :func:`lowbit_decode_whole`, the
    offset is subtracted and each piece of whole blocks multiplied by its scales."""
    b, per = block_size, 8 // bits
    blocks = -(-n // b)
    scales, packed = data[: 4 * blocks].view(torch.float32), data[4 * blocks : 4 * blocks + -(-n // per)]
    unit = math.lcm(b, per)
    main = n // unit * unit if sys.byteorder == "little" else 0
    step = piece_values(out.device, main, unit)
    lane = torch.int16 if bits == 4 else torch.int32
    mask = sum(((1 << bits) - 1) << (8 * i) for i in range(per))  # 0x0F0F or 0x03030303
    lanes = torch.empty(min(main, step) // per, dtype=lane, device=out.device)
    spread = torch.empty_like(lanes)
    for start in range(0, main, step):
        stop = min(main, start + step)
        w, t = lanes[: (stop - start) // per], spread[: (stop - start) // per]
        w.copy_(packed[start // per : stop // per])
        shift = 8 - bits  # code i moves from bit i·bits to bit 8·i
        while shift < 8 * per - 8:  # int2: w | w << 6, then that | itself << 12
            w.bitwise_or_(torch.bitwise_left_shift(w, shift, out=t))
            shift *= 2
        w.bitwise_and_(mask)
        piece = out[start:stop]
        piece.copy_(w.view(torch.uint8)).sub_(LOWBIT_OFFSET[bits])
        piece.view(-1, b).mul_(scales[start // b : stop // b, None])
    if main < n:
        lowbit_decode_whole(scales[main // b :], packed[main // per :], n - main, bits, b, out[main:])


def lowbit_decode_whole(scales: Tensor, packed: Tensor, n: int, bits: int, block_size: int, out: Tensor) -> None:
    """:func:`lowbit_decode` as whole-buffer operations: every code unpacked, cast, offset, then scaled."""
    b, per, mask = block_size, 8 // bits, (1 << bits) - 1
    blocks = -(-n // b)
    codes = torch.empty(packed.numel(), per, dtype=torch.uint8, device=out.device)
    for i in range(per):
        torch.bitwise_and(packed.bitwise_right_shift(i * bits), mask, out=codes[:, i])
    out.copy_(codes.view(-1)[:n]).sub_(LOWBIT_OFFSET[bits])
    full = n // b
    out[: full * b].view(full, b).mul_(scales[:full, None])
    if full < blocks:
        out[full * b :].mul_(scales[full])
