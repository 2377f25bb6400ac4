"""Sub-byte block formats: 4-bit and 2-bit values with one float32 absmax scale per block.

Each block of ``block_size`` values gets one float32 scale s and every value one code of ``bits`` bits,
packed ``8 / bits`` codes per byte (the first value in the lowest bits):

* ``int4``: the 15 symmetric levels q·s, q ∈ {−7, …, 7}, s = max|x| / 7, q = round(x / s) (to nearest,
  ties to even), stored as q + 8 (1 … 15). Zeros stay exact zeros.
* ``int2``: the 4 levels {−1.5, −0.5, 0.5, 1.5}·s, s = max|x| / 1.5, the code ⌊x / s⌋ + 2 (clamped to
  0 … 3) standing for (code − 1.5)·s: every code is used, and the nearest level is at most s/2 away
  (max|x| / 3), against max|x| / 2 for the three levels {−1, 0, 1}·max|x|. A zero in a block that is
  not all zeros comes back as ±s/2: with error feedback that is carried to the next payload.

Both: every value comes back within s/2 of itself (float rounding aside); a block of zeros has s = 0 and
decodes to zeros; the last block may be shorter. ``nbytes(n) = 4·⌈n / B⌉ + ⌈n·bits / 8⌉``, the scales
first (so that they can be read in place), then the packed codes. Rounding is to nearest: stochastic
rounding, unbiased in expectation, would only matter without error feedback and was not measured.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_loco.wire.base import Codec

LOWBIT_FORMATS = {"int4": 4, "int2": 2}


class LowBitBlockCodec(Codec):
    """Per-block absmax ``int4`` or ``int2`` (see the module docstring)."""

    def __init__(self, bits: int, block_size: int) -> None:
        if bits not in (4, 2):
            raise ValueError(f"LowBitBlockCodec takes bits=4 or bits=2, got {bits!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"int{bits}'s block_size must be an integer >= 1, got {block_size!r}")
        self.bits, self.block_size, self.name = bits, block_size, f"int{bits}"
        self.per_byte = 8 // bits
        self.top = 7.0 if bits == 4 else 1.5  # the largest level, in units of the scale
        self.offset = 8.0 if bits == 4 else 1.5  # the code of level v is v + offset (int2: ⌊x/s⌋ + 2)

    def blocks(self, n: int) -> int:
        return math.ceil(n / self.block_size)

    def packed_bytes(self, n: int) -> int:
        return math.ceil(n / self.per_byte)

    def nbytes(self, n: int) -> int:
        return 4 * self.blocks(n) + self.packed_bytes(n)

    def encode(self, x: Tensor) -> Tensor:
        x = x.detach().to(torch.float32).reshape(-1).contiguous()
        n, b = x.numel(), self.block_size
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        if not n:
            return out
        blocks = self.blocks(n)
        pad = blocks * b - n
        rows = (torch.cat([x, x.new_zeros(pad)]) if pad else x).view(blocks, b)
        scales = out[: 4 * blocks].view(torch.float32)
        torch.amax(rows.abs(), dim=1, out=scales)
        scales.div_(self.top)
        safe = torch.where(scales > 0, scales, 1.0)  # a zero block: 0 / 1 = 0
        y = rows / safe[:, None]
        if self.bits == 4:
            codes = y.round_().clamp_(-7, 7).add_(8)
        else:
            codes = y.floor_().clamp_(-2, 1).add_(2)
        flat = codes.view(-1).to(torch.uint8)
        spare = self.packed_bytes(n) * self.per_byte - flat.numel()
        if spare > 0:
            flat = torch.cat([flat, flat.new_zeros(spare)])
        grouped = flat[: self.packed_bytes(n) * self.per_byte].view(-1, self.per_byte)
        packed = out[4 * blocks :]
        packed.copy_(grouped[:, 0])
        for i in range(1, self.per_byte):
            packed.bitwise_or_(grouped[:, i].bitwise_left_shift(i * self.bits))
        return out

    def decode(self, data: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=data.device)
        if not n:
            return out
        b, blocks = self.block_size, self.blocks(n)
        scales = data[: 4 * blocks].view(torch.float32)
        packed = data[4 * blocks : 4 * blocks + self.packed_bytes(n)]
        mask = (1 << self.bits) - 1
        codes = torch.empty(packed.numel(), self.per_byte, dtype=torch.uint8, device=data.device)
        for i in range(self.per_byte):
            torch.bitwise_and(packed.bitwise_right_shift(i * self.bits), mask, out=codes[:, i])
        out.copy_(codes.view(-1)[:n]).sub_(self.offset)
        full = n // b
        out[: full * b].view(full, b).mul_(scales[:full, None])
        if full < blocks:
            out[full * b :].mul_(scales[full])
        return out
