"""The in-process network model (no root needed): run the real operation on loopback, then sleep
until the finish time the link model predicts. Every result produced this way is labelled
"modelled". It matches packet-level figures for latency-bound operations but ignores TCP dynamics
(about 20 % optimistic for 40 MB transfers, measured on these machines).

Times, for payload ``B`` bytes and the links of :class:`~benchmarks.netem.links.Network`:

* point to point i↔j (both directions at once): ``one_way(i, j) + B / min(bw_i, bw_j)``;
* all-reduce over N nodes (gloo and NCCL use a ring for large buffers): ``2(N−1)`` steps, each the
  slowest link's latency plus ``B/N`` at the slowest bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from benchmarks.netem.links import ENV, Network, from_env, to_env
from lightning_loco.transport import PendingSum, TorchDistributedTransport
from lightning_loco.transport.base import FIRST_ROUND, RoundId
from lightning_loco.wire.codecs import Codec

__all__ = ["ENV", "HeldPending", "ModelledTransport", "allreduce_s", "from_env", "pair_s", "to_env", "wait_until"]


def pair_s(network: Network, i: int, peers: Sequence[int], nbytes: int) -> float:
    return max((network.transfer_s(i, j, nbytes) for j in peers), default=0.0)


def allreduce_s(network: Network, nbytes: int, nodes: Sequence[int] | None = None) -> float:
    """A ring all-reduce over ``nodes`` (default: all)."""
    ring = list(range(len(network.links))) if nodes is None else list(nodes)
    n = len(ring)
    if n < 2:
        return 0.0
    latency = max(network.one_way_s(ring[i], ring[(i + 1) % n]) for i in range(n))
    rate = min(network.links[i].bytes_per_s for i in ring)
    return 2 * (n - 1) * (latency + nbytes / n / rate)


def wait_until(start: float, modelled: float) -> None:
    remaining = start + modelled - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class HeldPending(PendingSum):
    """A real exchange whose completion is held back until the modelled link would have finished."""

    ready_at = 0.0  # a time.perf_counter() value

    def done(self) -> bool:
        return time.perf_counter() >= self.ready_at and super().done()

    def completed_after(self) -> float | None:
        seen = super().completed_after()
        return None if seen is None or not self.done() else max(seen, self.ready_at - self.started)

    def wait(self) -> Tensor:
        if self._result is None:
            blocked = time.perf_counter()
            wait_until(self.ready_at, 0.0)
            held = time.perf_counter() - blocked
            total = super().wait()
            self.wait_seconds += held
            return total
        return super().wait()


class ModelledTransport(TorchDistributedTransport):
    """The real transport on loopback, held until the modelled network would have finished."""

    def __init__(self, *args: Any, network: Network | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.network = network or from_env()
        if self.network is None:
            raise ValueError(f"no network to model: pass network= or set {ENV}")

    def pending(self, works: list[Any], finish: Any, nbytes: int, peers: tuple[int, ...]) -> PendingSum:
        return HeldPending(self, works, finish, nbytes, peers)

    # Nodes are global ranks; with ranks_per_replica > 1 each rank moves its slice only, and the
    # all-gather inside the replica is taken to run on a fast local link (it is not held).

    # A lossy ``codec`` is passed on; the modelled time is that of the codec's bytes.

    def _nbytes(self, payload: Tensor, codec: Codec | None) -> int:
        part = self.slice(payload)
        if codec is not None and codec.lossy:
            return codec.nbytes(part.numel())
        return part.numel() * payload.element_size()

    def start_group_sum(self, payload: Tensor, group: Sequence[int], codec: Codec | None = None,
                        round_id: RoundId = FIRST_ROUND) -> HeldPending:
        pending = super().start_group_sum(payload, group, codec, round_id)
        assert isinstance(pending, HeldPending)
        peers = [self.replica_ranks[j] for j in group if j != self.replica]
        if peers:  # completion (and the recorded communication time) waits for the modelled finish
            nbytes = self._nbytes(payload, codec)
            pending.ready_at = pending.started + pair_s(self.network, dist.get_rank(), peers, nbytes)
        return pending

    def start_all_reduce_sum(self, payload: Tensor, codec: Codec | None = None,
                             round_id: RoundId = FIRST_ROUND) -> HeldPending:
        pending = super().start_all_reduce_sum(payload, codec, round_id)
        assert isinstance(pending, HeldPending)
        nbytes = self._nbytes(payload, codec)
        pending.ready_at = pending.started + allreduce_s(self.network, nbytes, self.replica_ranks)
        return pending
