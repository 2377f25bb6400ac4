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
same order, so the encoded bytes and the decoded floats are bitwise those of the whole-buffer
formulation (``tests/test_codecs.py`` holds them against it).
"""

from __future__ import annotations

import torch
from torch import Tensor

PIECE_BYTES = 1 << 22  # float32 bytes of one piece on a single-threaded CPU: 4 MiB


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
