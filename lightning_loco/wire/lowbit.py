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

from lightning_loco.wire import kernels
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
        self.top = kernels.LOWBIT_TOP[bits]  # the largest level, in units of the scale
        self.offset = kernels.LOWBIT_OFFSET[bits]  # the code of level v is v + offset (int2: ⌊x/s⌋ + 2)

    def blocks(self, n: int) -> int:
        return math.ceil(n / self.block_size)

    def packed_bytes(self, n: int) -> int:
        return math.ceil(n / self.per_byte)

    def nbytes(self, n: int) -> int:
        return 4 * self.blocks(n) + self.packed_bytes(n)

    def encode(self, x: Tensor) -> Tensor:
        x = x.detach().to(torch.float32).reshape(-1).contiguous()
        out = torch.empty(self.nbytes(x.numel()), dtype=torch.uint8, device=x.device)
        if x.numel():
            kernels.lowbit_encode(x, self.bits, self.block_size, out)
        return out

    def decode(self, data: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=data.device)
        if n:
            kernels.lowbit_decode(data, n, self.bits, self.block_size, out)
        return out
