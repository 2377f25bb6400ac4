"""The lossy wire formats, over any :class:`~lightning_loco.transport.base.PointToPoint` transport
(:class:`~lightning_loco.transport.torch_dist.TorchDistributedTransport`, and the elastic transport).

With a lossy ``codec`` (:mod:`lightning_loco.wire.codecs`) the bytes on the wire are the codec's:

* group sums send each rank's encoded slice; every member decodes every payload, its own included,
  and sums in float32 in ascending replica order;
* the all-reduce becomes an all-to-all of encoded chunks (chunk c goes to replica c), a float32 sum
  of the decoded chunks in ascending replica order, and an all-gather of each encoded reduced chunk,
  all point to point: 2(N−1)/N × the codec's size per replica, and bitwise the same result on every
  replica. The all-to-all runs in the background; the all-gather runs when the sum is waited for. A
  codec that ``gathers`` (topk: a sum of sparse payloads is not sparse) is an all-gather instead: the
  group sum of all N replicas, (N−1) × the codec's size per replica.

Encoded buffers are small and are not staged: a CUDA payload on gloo is encoded on its device and
copied to the host. Both functions take the transport, post with its point-to-point ``exchange``, and
return its kind of :class:`~lightning_loco.transport.base.Pending`; with several ranks per replica each
rank moves its own slice and the replica's ranks gather the result, as in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_loco.transport.base import Pending, PointToPoint, RoundId
from lightning_loco.wire.codecs import Codec, all_reduce_bytes, decode_sum


def start_group_sum(
    transport: PointToPoint, payload: Tensor, group: Sequence[int], others: list[int], codec: Codec, round_id: RoundId
) -> Pending:
    """Posts the group's exchange of encoded slices (``others``: the group less this replica)."""
    works, total, nbytes = _post_group_sum(transport, payload, group, others, codec, round_id)
    return transport.pending(works, total, nbytes, tuple(others))


def _post_group_sum(
    transport: PointToPoint, payload: Tensor, group: Sequence[int], others: list[int], codec: Codec, round_id: RoundId
) -> tuple[list[Any], Callable[[], Tensor], int]:
    """Posts the exchange of encoded slices: its works, the function that sums them once they completed
    (a new tensor of the payload's shape, on its device), and the bytes this replica sends."""
    part = transport.slice(payload)
    n = part.numel()
    send = codec.encode(part.contiguous()).to(transport.device)  # encoded where the payload is
    received = {j: torch.empty(codec.nbytes(n), dtype=torch.uint8, device=transport.device) for j in others}
    works = transport.exchange(dict.fromkeys(others, send), received, round_id)

    def finish() -> Tensor:
        encoded = {**received, transport.replica: send}
        total = decode_sum(encoded, n, codec, group)
        return transport.gather_slices(total, payload).to(payload.device)

    return works, finish, codec.nbytes(n) * len(others)


def start_all_reduce_sum(transport: PointToPoint, payload: Tensor, codec: Codec, round_id: RoundId) -> Pending:
    """Posts the all-to-all half of the chunked all-reduce; the all-gather half runs in ``wait()``,
    and the sum lands in ``payload``."""
    num, me = transport.num_replicas, transport.replica
    if codec.gathers:  # a sparse format: the sum of every replica's whole payload, as a group of all
        others = [j for j in range(num) if j != me]
        works, total, nbytes = _post_group_sum(transport, payload, range(num), others, codec, round_id)
        return transport.pending(works, lambda: payload.copy_(total().view_as(payload)), nbytes, tuple(others))
    part = transport.slice(payload)
    peers = tuple(j for j in range(num) if j != me)
    chunks = torch.tensor_split(part, num)
    sizes = [c.numel() for c in chunks]
    encoded = [codec.encode(c.contiguous()).to(transport.device) for c in chunks]  # encoded where the payload is
    mine = {j: torch.empty(codec.nbytes(sizes[me]), dtype=torch.uint8, device=transport.device) for j in peers}
    works = transport.exchange({j: encoded[j] for j in peers}, mine, round_id)  # the all-to-all (reduce-scatter half)

    def finish() -> Tensor:
        reduced = codec.encode(decode_sum({**mine, me: encoded[me]}, sizes[me], codec, range(num)))
        gathered = {j: torch.empty(codec.nbytes(sizes[j]), dtype=torch.uint8, device=transport.device) for j in peers}
        for work in transport.exchange(dict.fromkeys(peers, reduced), gathered, round_id):  # the all-gather half
            work.wait()
        gathered[me] = reduced
        total = torch.cat([codec.decode(gathered[j], sizes[j]) for j in range(num)])
        whole = transport.gather_slices(total, payload)
        payload.copy_(whole)
        return payload

    return transport.pending(works, finish, all_reduce_bytes(codec, part.numel(), num, me), peers)
