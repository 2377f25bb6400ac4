"""Sparse top-k of each chunk, for payloads that are pseudo-gradients (SparseLoCo-style).

The flat buffer is cut into chunks of ``chunk`` values (the last may be shorter). Of a chunk of c values,
the k(c) = min(c, max(1, ⌈density·c⌉)) of largest magnitude are sent: their positions inside the chunk
as ``uint16`` (``chunk`` ≤ 65536), in ascending order, and their signed values in ``value_format``:

* ``int8``, ``int4`` or ``int2``: the block formats with one float32 scale per chunk (block size k of a
  full chunk: each chunk's values are one block);
* ``float16``: the values cast (2 bytes each; no |x| > 65504).

Everything else decodes to zero; the decoded buffer is dense float32. With error feedback
(:class:`~lightning_loco.wire.codecs.WireFormat`) what is not sent stays in the residual and travels
later, so nothing is lost for good. Layout: the values' encoding first (its scales read in place), a
zero byte where needed to make its length even, then the indices:
``nbytes(n) = even(V(m)) + 2·m`` with m = Σ k over the chunks and V the value format's size of m values.

A sum of such payloads is not sparse, so a collective round does not re-encode one: the codec
``gathers`` (:class:`~lightning_loco.wire.base.Codec`), every replica's encoded payload goes to every
other, and each decodes and adds all N in float32 in ascending replica order: bitwise the same sum
everywhere, for (N − 1)·nbytes(n) bytes sent per replica, growing with N.

How the N sparse payloads are averaged (``mean``):

* ``"replicas"``: their sum, which the algorithm divides by N as for any format: a position one replica
  sent counts 1/N of its value, as if the others had sent zero there;
* ``"senders"`` (SparseLoCo's aggregation): each position's mean over the replicas that sent it, delivered as
  that mean × N so that the algorithm's division by N gives it; a position nobody sent stays 0. The counts come
  from the indices, the same on every member, so the result is bitwise the same everywhere too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_loco.wire.base import Codec
from lightning_loco.wire.kernels import piece_values

VALUE_FORMATS = ("int8", "int4", "int2", "float16")
DEFAULT_DENSITY = 0.02
DEFAULT_VALUE_FORMAT = "int2"
DEFAULT_CHUNK = 4096
MEANS = ("replicas", "senders")
DEFAULT_MEAN = "senders"  # SparseLoCo's
DEFAULT_DECAY = 0.95  # SparseLoCo's error-feedback decay, topk's default


class TopKCodec(Codec):
    """Top-k of each chunk with compact indices and low-bit values (see the module docstring)."""

    name = "topk"
    gathers = True

    def __init__(self, values: Codec, density: float = DEFAULT_DENSITY, chunk: int = DEFAULT_CHUNK,
                 mean: str = DEFAULT_MEAN) -> None:
        """``values``: the chosen values' codec (one of :data:`VALUE_FORMATS`; a block format with block size
        ``kept(density, chunk)``: :func:`~lightning_loco.wire.codecs.make_codec` builds it). ``mean``: how a
        group's payloads are averaged, one of :data:`MEANS` (the module docstring)."""
        check_density(density)
        if mean not in MEANS:
            raise ValueError(f"topk's mean must be one of {', '.join(map(repr, MEANS))}, got {mean!r}")
        self.mean = mean
        if values.name not in VALUE_FORMATS:
            raise ValueError(f"topk's value_format must be one of {', '.join(map(repr, VALUE_FORMATS))}, "
                             f"got {values.name!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 65536:
            raise ValueError(f"topk's chunk must be an integer in [1, 65536], got {chunk!r}")
        self.density, self.value_format, self.chunk = float(density), values.name, chunk
        self.k = self.kept(chunk)
        self.values = values

    def kept(self, c: int) -> int:
        """How many of a chunk of ``c`` values are sent."""
        return kept(self.density, c)

    def selected(self, n: int) -> int:
        """How many of ``n`` values are sent."""
        full, rest = divmod(n, self.chunk)
        return full * self.k + self.kept(rest)

    def _value_bytes(self, m: int) -> int:
        v = self.values.nbytes(m)
        return v + (v & 1)

    def nbytes(self, n: int) -> int:
        m = self.selected(n)
        return self._value_bytes(m) + 2 * m

    def encode(self, x: Tensor) -> Tensor:
        x = x.detach().to(torch.float32).reshape(-1).contiguous()
        n, c = x.numel(), self.chunk
        out = torch.zeros(self.nbytes(n), dtype=torch.uint8, device=x.device)
        if not n:
            return out
        full = n // c
        m = self.selected(n)
        indices = torch.empty(m, dtype=torch.int64, device=x.device)
        values = torch.empty(m, dtype=torch.float32, device=x.device)
        if full:
            fk, k = full * self.k, self.k
            _select(x[: full * c].view(full, c), k, indices[:fk].view(full, k), values[:fk].view(full, k))
        if full * c < n:
            tail = x[full * c :].view(1, -1)
            k = self.kept(tail.numel())
            _top(tail, k, indices[full * self.k :].view(1, k), values[full * self.k :].view(1, k))
        v = self._value_bytes(m)
        out[: self.values.nbytes(m)].copy_(self.values.encode(values))
        out[v:].view(torch.int16).copy_(indices.to(torch.int32).to(torch.int16))  # 0 … 65535 as 16 bits
        return out

    def _indices(self, data: Tensor, m: int) -> Tensor:
        """The positions inside their chunks of the ``m`` values in ``data`` (int64)."""
        v = self._value_bytes(m)
        return data[v : v + 2 * m].view(torch.int16).to(torch.int64).bitwise_and_(0xFFFF)

    def positions(self, data: Tensor, n: int) -> Tensor:
        """The positions in the whole buffer of ``n`` values of the values ``data`` carries (int64, ascending)."""
        m = self.selected(n)
        indices = self._indices(data, m)
        full = n // self.chunk
        fk = full * self.k
        offsets = torch.arange(full, dtype=torch.int64, device=data.device).mul_(self.chunk).repeat_interleave(self.k)
        indices[:fk].add_(offsets)
        indices[fk:].add_(full * self.chunk)
        return indices

    def finish_sum_(self, total: Tensor, encoded: Sequence[Tensor]) -> Tensor:
        """With ``mean="senders"``: each position of the sum × (members / members that sent it)."""
        if self.mean == "replicas" or not total.numel():
            return total
        n = total.numel()
        counts = torch.zeros_like(total)
        one = torch.ones(self.selected(n), dtype=total.dtype, device=total.device)
        for data in encoded:  # the positions of one payload are distinct: each adds 1 where it sent a value
            counts.index_add_(0, self.positions(data, n), one)
        return total.mul_(float(len(encoded))).div_(counts.clamp_(min=1.0))

    def decode(self, data: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=data.device)
        out.zero_()
        if not n:
            return out
        c, m = self.chunk, self.selected(n)
        values = self.values.decode(data[: self.values.nbytes(m)], m)
        indices = self._indices(data, m)
        full = n // c
        if full:
            fk = full * self.k
            out[: full * c].view(full, c).scatter_(1, indices[:fk].view(full, self.k), values[:fk].view(full, self.k))
        if full * c < n:
            out[full * c :].scatter_(0, indices[full * self.k :], values[full * self.k :])
        return out

    def check(self, largest: float) -> str | None:
        return self.values.check(largest)

    def __repr__(self) -> str:
        return (f"TopKCodec(density={self.density!r}, value_format={self.value_format!r}, chunk={self.chunk}, "
                f"mean={self.mean!r})")


def check_density(density: float) -> None:
    """Raises ``ValueError`` unless ``density`` is a number in (0, 1]."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"topk's density must be a number in (0, 1], got {density!r}")


def kept(density: float, c: int) -> int:
    """How many of a chunk of ``c`` values top-k at ``density`` sends: min(c, max(1, ⌈density·c⌉))."""
    return min(c, max(1, math.ceil(density * c))) if c else 0


def _top(rows: Tensor, k: int, indices: Tensor, values: Tensor) -> None:
    """The ``k`` entries of largest magnitude of each row: their positions in ascending order into
    ``indices``, their signed values into ``values``."""
    chosen = torch.topk(rows.abs(), k, dim=1, sorted=False).indices
    chosen, _ = torch.sort(chosen, dim=1)
    indices.copy_(chosen)
    torch.gather(rows, 1, chosen, out=values)


def _select(rows: Tensor, k: int, indices: Tensor, values: Tensor) -> None:
    """:func:`_top`, bitwise, without a selection over every value: a piece of rows at a time
    (:func:`~lightning_loco.wire.kernels.piece_values`), each row is cut into G ≥ k groups of g values and
    the k-th largest of the G group maxima of |x| is a bound that at least k values reach (one in each of
    those k groups), and few more (about 3 % of a Gaussian chunk of 4096 for k = 82, g = 32). The top k
    are chosen among the values that reach it, held in a (rows, 2k) table in their order. A row's choice
    is the k largest when exactly k candidates reach the k-th largest one (no tie across the cut): a set
    torch.topk must return too. The other rows (ties, NaN, over 2k candidates) go through :func:`_top`.

    Only on a CPU where torch runs one thread: its two dozen operations per piece, several of them
    serial, lost to one torch.topk parallel over the rows with two threads on a busy machine (10 M
    values: 1.07 s against 0.48 s), and on an accelerator ``nonzero`` would wait for the device."""
    r, c = rows.shape
    g = next((g for g in (32, 16, 8, 4, 2) if c % g == 0 and c // g >= k), 0)
    if not g or rows.device.type != "cpu" or torch.get_num_threads() > 1:
        _top(rows, k, indices, values)
        return
    step = max(1, piece_values(rows.device, r * c) // c)
    work = torch.empty(min(r, step), c, dtype=rows.dtype, device=rows.device)
    for start in range(0, r, step):
        stop = min(r, start + step)
        _select_piece(rows[start:stop], k, g, work[: stop - start], indices[start:stop])
        torch.gather(rows[start:stop], 1, indices[start:stop], out=values[start:stop])  # rows still cached


def _select_piece(rows: Tensor, k: int, g: int, a: Tensor, indices: Tensor) -> None:
    """The ascending positions of each row's top k into ``indices`` (see :func:`_select`); ``a``: scratch."""
    r, c = rows.shape
    width = min(c, 2 * k)  # candidates held per row
    torch.abs(rows, out=a)
    maxima = a.view(r, c // g, g).amax(dim=2)  # NaN in a row makes its bound NaN: no candidate
    bound = torch.topk(maxima, k, dim=1, sorted=False).values.amin(dim=1)
    flat = torch.nonzero(torch.ge(a, bound[:, None]).view(-1)).view(-1)  # the candidates, in order
    value = a.view(-1).index_select(0, flat)
    row = flat.div(c, rounding_mode="floor")
    counts = torch.bincount(row, minlength=r)
    slots = torch.arange(width, device=a.device)
    where = (torch.cumsum(counts, 0) - counts)[:, None] + slots  # each row's candidates, then others
    table = value[where.clamp_(max=max(flat.numel() - 1, 0))] if flat.numel() else a.new_empty(r, width)
    table = torch.where(slots < counts[:, None], table, -1.0)  # -1: below every |x|
    kth = torch.topk(table, k, dim=1, sorted=False).values.amin(dim=1)
    ok = (counts >= k) & (counts <= width) & ((table >= kth[:, None]).sum(dim=1) == k)
    chosen = (value >= kth[row]).logical_and_(ok[row])
    indices[ok] = (flat[chosen] - row[chosen] * c).view(-1, k)
    rest = torch.nonzero(~ok).view(-1)
    if rest.numel():
        chosen_rest = torch.empty(rest.numel(), k, dtype=indices.dtype, device=indices.device)
        _top(rows[rest], k, chosen_rest, torch.empty(rest.numel(), k, dtype=rows.dtype, device=rows.device))
        indices[rest] = chosen_rest
