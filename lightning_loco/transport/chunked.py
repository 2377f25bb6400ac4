"""The float32 all-reduce built from point-to-point exchanges: what ``TorchDistributedTransport`` runs on gloo
with three replicas or more, for payloads of :data:`MIN_BYTES` or more.

A payload (this rank's slice of it, with replicas of several ranks) is cut into N chunks
(``torch.tensor_split``); replica j owns chunk j.

1. **Reduce-scatter.** Each replica sends chunk j of its payload to replica j and receives chunk ``me``
   from every other one: one ``exchange`` with all N − 1 peers, posted at once, every message in flight
   together (and each cut over the transport's streams). The owner sums the N pieces of its chunk in
   float32 in ascending replica order, whoever sent first: the sum does not depend on timing, and is
   bitwise the elementwise sum ``x_0 + x_1 + … + x_{N−1}`` of :func:`~lightning_loco.transport.base.sum_in_group_order`.
2. **All-gather.** Each owner sends its summed chunk to every other replica, straight into the chunk's place
   in the payload: every replica ends with the same bits.

Each replica sends (N − 1)/N of a payload in each half: 2(N − 1)/N copies, the bandwidth-optimal figure of
a ring all-reduce (:func:`~lightning_loco.wire.codecs.ring_all_reduce_bytes`, which the stats count), in two
exchanges, each waiting about one round trip plus its bytes' time. gloo's own all-reduce moves the payload in
2(N − 1) ring steps of small pieces, each waiting a round trip: on a long fat pipe it reaches a tenth of the
link (``benchmarks/link_efficiency.py``). This is the same shape as the lossy formats' all-reduce
(:mod:`~lightning_loco.wire.coded`) without a codec.

The reduce-scatter runs in the background (``done()`` turns true when it completed); the all-gather runs
when the sum is waited for. Payloads under :data:`MIN_BYTES` keep gloo's all-reduce: they fit in a few
packets, the ring's round trips are few, and their sums stay what they were. NCCL's all-reduce is never
replaced (it runs on the GPU's own channels and sockets).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_loco.transport.base import Pending, RoundId, sum_in_group_order
from lightning_loco.wire.codecs import ring_all_reduce_bytes

__all__ = ["MIN_BYTES", "start_chunked_all_reduce"]

MIN_BYTES = 64 << 10
"""The smallest payload slice (bytes) that takes the chunked all-reduce on gloo: 16 Ki float32 values."""


def start_chunked_all_reduce(transport: Any, payload: Tensor, round_id: RoundId) -> Pending:
    """Posts the reduce-scatter half over ``transport`` (a
    :class:`~lightning_loco.transport.torch_dist.TorchDistributedTransport`); the all-gather half runs in
    ``wait()``, and the sum lands in ``payload``."""
    num, me = transport.num_replicas, transport.replica
    peers = tuple(j for j in range(num) if j != me)
    staged = transport._staged(payload)
    buf = transport.staging.to_host(payload) if staged else payload.to(transport.device)
    part = transport.slice(buf)
    chunks = torch.tensor_split(part.view(-1), num)  # views: what lands in them lands in ``buf``
    received = {j: torch.empty_like(chunks[me]) for j in peers}
    works = transport.exchange({j: chunks[j] for j in peers}, received, round_id)  # the reduce-scatter

    def finish() -> Tensor:
        chunks[me].copy_(sum_in_group_order({**received, me: chunks[me]}, range(num)))
        gather = transport.exchange(dict.fromkeys(peers, chunks[me]), {j: chunks[j] for j in peers}, round_id)
        for work in gather:  # the all-gather, into the payload's own chunks
            work.wait()
        whole = transport.gather_slices(part, buf)
        if whole.data_ptr() != payload.data_ptr():
            payload.copy_(whole.view_as(payload), non_blocking=staged and transport.staging.pinned)
        if staged:
            transport.staging.give_back(buf)
        return payload

    nbytes = ring_all_reduce_bytes(part.numel() * part.element_size(), num)
    return transport.pending(works, finish, nbytes, peers)
