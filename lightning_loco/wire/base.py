"""The codec interface every wire format implements (:mod:`lightning_loco.wire.codecs` lists the formats)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from torch import Tensor


class Codec(ABC):
    """Encodes flat float32 buffers into ``nbytes(n)`` bytes and back."""

    name: str
    lossy: bool = True
    # True where a sum of encoded payloads cannot be encoded again as compactly (a sparse format): the
    # all-reduce then gathers every replica's encoded payload to everyone instead of cutting it in chunks
    gathers: bool = False

    @abstractmethod
    def nbytes(self, n: int) -> int:
        """Exact size in bytes of ``n`` encoded values."""

    @abstractmethod
    def encode(self, x: Tensor) -> Tensor:
        """A flat float32 tensor → a flat ``uint8`` tensor of ``nbytes(x.numel())`` bytes (same device)."""

    @abstractmethod
    def decode(self, data: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        """The ``uint8`` buffer of ``n`` encoded values → a flat float32 tensor: a new one, or
        ``out`` (``n`` float32 values on the data's device) filled and returned."""

    def decode_add_(self, total: Tensor, data: Tensor) -> Tensor:
        """``total += D(data)`` for the ``total.numel()`` values in ``data``, bitwise
        ``total.add_(self.decode(data, total.numel()))``; codecs override it to skip the decoded copy."""
        return total.add_(self.decode(data, total.numel()))

    def finish_sum_(self, total: Tensor, encoded: Sequence[Tensor]) -> Tensor:
        """The group's sum ``total`` of the decoded ``encoded`` payloads (every member's, in ascending replica
        order), as the exchange delivers it: the sum itself for every codec but a sparse one that averages each
        position over the members that sent it (:class:`~lightning_loco.wire.sparse.TopKCodec`)."""
        return total

    def roundtrip(self, x: Tensor) -> Tensor:
        """D(Q(x)): what a receiver gets for ``x``."""
        return self.decode(self.encode(x), x.numel())

    def check(self, largest: float) -> str | None:
        """Why a finite payload whose largest |value| is ``largest`` cannot be sent in this format, or ``None``."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
