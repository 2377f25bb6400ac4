"""Streams: one exchange spread over s connections per pair (``TorchDistributedTransport(streams=s)``).

``streams`` = s > 1 cuts every message and every all-reduce into s pieces, each over a process group of its own
(gloo gives every group its own connections): s TCP connections per pair carry one exchange. One connection
carries at most its send buffer per round trip, and gloo's all-reduce waits a round trip per step, so on a long
fat pipe a single connection leaves most of the link idle (``benchmarks/link_efficiency.py``). The groups are
made when the transport is built, by every rank of the world (``dist.new_group`` is collective). Pieces land in
the same buffers, so a pair exchange's sum is bitwise the same for every s; an all-reduce of the pieces adds
the same values in the order gloo chooses for each piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["make_stream_groups", "piece"]


def make_stream_groups(process_group: Optional[Any], streams: int, given: Optional[Sequence[Any]]) -> list[Any]:
    """The s process groups one exchange is spread over: ``process_group`` first, then the s − 1 extra ones,
    ``given`` by the caller (the strategies': made with the run's backend and timeout) or else made here with
    ``process_group``'s ranks and backend. Making them is collective: every rank of the world builds its
    transport, in the same order."""
    groups: list[Any] = [process_group]
    if given is not None:
        if len(given) != streams - 1:
            raise ValueError(f"streams={streams} takes {streams - 1} stream_groups, got {len(given)}")
        groups += list(given)
    elif streams > 1:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        backend = dist.get_backend(process_group)
        groups += [dist.new_group(ranks=ranks, backend=backend) for _ in range(streams - 1)]
    return groups


def piece(buf: Tensor, index: int, streams: int) -> Tensor:
    """Piece ``index`` of ``streams`` of a contiguous buffer (a view: what lands in it lands in ``buf``)."""
    if streams == 1:
        return buf
    return torch.tensor_split(buf.view(-1), streams)[index]
