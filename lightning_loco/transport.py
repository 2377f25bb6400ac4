"""Moving flat buffers between replicas with ``torch.distributed``.

Two operations cover every algorithm:

* ``group_sum``: point-to-point inside one group (NoLoCo's groups, GASLoC's pairs). Each member
  sends its one flat buffer to every other member and sums what it has in ascending replica order,
  so all members hold bitwise the same sum. Receives are posted before sends: gloo otherwise runs
  the two directions of a pair one after the other, twice as slow on a slow link.
* ``all_reduce_sum``: one collective over all replicas (DiLoCo).

A replica is one rank today. ``replica_ranks`` maps replica index to global rank so that a replica
may later span several ranks without changing the algorithms.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Transport(Protocol):
    replica: int
    num_replicas: int

    def group_sum(self, payload: Tensor, group: Sequence[int]) -> Tensor:
        """The sum of the group's payloads, as a new tensor; ``payload`` is left unchanged."""
        ...

    def all_reduce_sum(self, payload: Tensor) -> Tensor:
        """The sum over all replicas, computed in place in ``payload`` and returned."""
        ...


def sum_in_group_order(buffers: dict[int, Tensor], group: Sequence[int]) -> Tensor:
    """Sums the group's buffers in ascending replica order (a new tensor, identical on all members)."""
    order = sorted(group)
    total = buffers[order[0]].clone()
    for j in order[1:]:
        total.add_(buffers[j])
    return total


@dataclass
class TransportStats:
    """Running totals of this replica's traffic (payload bytes, not counting protocol overhead)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    calls: int = 0
    last_bytes_sent: int = 0
    last_bytes_received: int = 0
    last_seconds: float = 0.0
    last_peers: tuple[int, ...] = field(default_factory=tuple)

    def record(self, sent: int, received: int, seconds: float, peers: tuple[int, ...]) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.seconds += seconds
        self.calls += 1
        self.last_bytes_sent, self.last_bytes_received = sent, received
        self.last_seconds, self.last_peers = seconds, peers


class TorchDistributedTransport:
    """``Transport`` over an initialised ``torch.distributed`` process group.

    Args:
        device: where buffers must be to cross the network (CUDA for NCCL, CPU for gloo). Payloads
            elsewhere are copied there and the result is copied back.
        process_group: the group to use (default: the world).
        replica_ranks: the global rank of each replica (default: replica ``i`` is rank ``i``).
    """

    def __init__(
        self,
        device: torch.device,
        process_group: Optional[Any] = None,
        replica_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedTransport needs an initialised torch.distributed process group")
        self.device = torch.device(device)
        self.process_group = process_group
        world = dist.get_world_size(process_group)
        self.replica_ranks = list(range(world)) if replica_ranks is None else list(replica_ranks)
        self.num_replicas = len(self.replica_ranks)
        self.replica = self.replica_ranks.index(dist.get_rank())
        self.stats = TransportStats()

    def group_sum(self, payload: Tensor, group: Sequence[int]) -> Tensor:
        if self.replica not in group:
            raise ValueError(f"replica {self.replica} is not in the group {tuple(group)}")
        others = [j for j in group if j != self.replica]
        if not others:
            return payload.clone()  # always a new tensor, as for a real group: callers may update it in place
        start = time.perf_counter()
        send = payload.to(self.device).contiguous()
        received = {j: torch.empty_like(send) for j in others}
        ops = [dist.P2POp(dist.irecv, received[j], self.replica_ranks[j], self.process_group) for j in others]
        ops += [dist.P2POp(dist.isend, send, self.replica_ranks[j], self.process_group) for j in others]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        received[self.replica] = send
        total = sum_in_group_order(received, group).to(payload.device)
        nbytes = send.numel() * send.element_size() * len(others)
        self.stats.record(nbytes, nbytes, time.perf_counter() - start, tuple(others))
        return total

    def all_reduce_sum(self, payload: Tensor) -> Tensor:
        start = time.perf_counter()
        buf = payload.to(self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.process_group)
        if buf.data_ptr() != payload.data_ptr():
            payload.copy_(buf)
        # A ring all-reduce sends and receives 2(N−1)/N copies per replica; gloo and NCCL pick their
        # own algorithm, so this is the nominal figure, not a measurement.
        n = self.num_replicas
        nbytes = 2 * (n - 1) * payload.numel() * payload.element_size() // n
        peers = tuple(j for j in range(n) if j != self.replica)
        self.stats.record(nbytes, nbytes, time.perf_counter() - start, peers)
        return payload
