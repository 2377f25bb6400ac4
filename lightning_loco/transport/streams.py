"""Streams: one exchange spread over s connections per pair (``TorchDistributedTransport(streams=s)``).

``streams`` = s > 1 cuts every message and every all-reduce into s pieces, each over a process group of its own
(gloo gives every group its own connections): s TCP connections per pair carry one exchange. One connection
carries at most its send buffer per round trip, and gloo's all-reduce waits a round trip per step, so on a long
fat pipe a single connection leaves most of the link idle (``benchmarks/link_efficiency.py``). The groups are
made when the transport is built, by every rank of the world (``dist.new_group`` is collective). Pieces land in
the same buffers, so a pair exchange's sum is bitwise the same for every s (and so is the chunked all-reduce's,
:mod:`~lightning_loco.transport.chunked`); gloo's own all-reduce of the pieces adds the same values in the order
gloo chooses for each piece.

``streams="auto"`` (the strategies' default, ``WireConfig(streams="auto")``) chooses the count from the bytes: each
message is cut into one piece per :data:`AUTO_BYTES_PER_STREAM` it holds, at least 1 and at most the groups there
are (:func:`auto_streams`), and the strategies make as many groups as the whole model's payload would use (at most
:data:`AUTO_MAX_STREAMS`). A 4 MB piece is what one connection with the host's usual largest send buffer (Linux's
``net.ipv4.tcp_wmem``, 4 MB) carries per round trip: a message under 8 MB goes whole, over one connection, and a
model under 8 MB makes no group; 8 connections (B7, ``benchmarks/link_efficiency.py``) carried 72 % of the best
plain TCP on a long fat pipe. Every side of a message computes its count from the message's own size, so sender and
receiver cut it alike. A pair exchange (NoLoCo, GASLoC, two replicas' all-reduce) also measures whether one
connection is faster, as on a link whose bandwidth × round trip one send buffer covers, and takes it where both
sides of the pair found it so (:mod:`~lightning_loco.transport.pair_streams`). "auto" is one stream where streams
cannot work: on NCCL (its own sockets, ``NCCL_NSOCKS_PERTHREAD`` and ``NCCL_SOCKET_NTHREADS``, and each group one
more communicator on the GPU), with replicas of several ranks (each rank already moves its own slice over its own
connections, and every rank's groups would multiply), and on a transport that is not the strategies' own (elastic
replicas, a ``transport_factory``), which takes no stream groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AUTO", "AUTO_BYTES_PER_STREAM", "AUTO_MAX_STREAMS", "auto_stream_groups", "auto_streams",
           "make_stream_groups", "piece"]

AUTO = "auto"
AUTO_BYTES_PER_STREAM = 4 << 20
"""With ``streams="auto"``: a message gets one piece (one connection) per this many bytes."""
AUTO_MAX_STREAMS = 8
"""With ``streams="auto"``: the most pieces a message is cut into (and groups made)."""


def auto_streams(nbytes: int, most: int = AUTO_MAX_STREAMS) -> int:
    """The pieces a message of ``nbytes`` is cut into with ``streams="auto"``: one per
    :data:`AUTO_BYTES_PER_STREAM`, at least 1, at most ``most``."""
    return max(1, min(most, nbytes // AUTO_BYTES_PER_STREAM))


def auto_stream_groups(model_bytes: int, backend: str, ranks_per_replica: int) -> int:
    """How many groups (the default one included) ``streams="auto"`` uses for a model of ``model_bytes`` on
    ``backend``: 1 on NCCL and with replicas of several ranks (see the module docstring)."""
    if backend != "gloo" or ranks_per_replica > 1:
        return 1
    return auto_streams(model_bytes)


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
