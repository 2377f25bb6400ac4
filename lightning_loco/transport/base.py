"""The interface between the outer-step driver and whatever moves buffers between replicas.

Two operations cover every algorithm:

* ``start_group_sum(payload, group)``: point to point inside one group (NoLoCo's groups, GASLoC's
  pairs). Every member ends with bitwise the same sum of the group's payloads, added in ascending
  replica order;
* ``start_all_reduce_sum(payload)``: one collective over all replicas (DiLoCo), summed in place.

Both post the operation and return a :class:`Pending` at once; ``Pending.wait()`` returns the sum.
Both take an optional lossy ``codec`` (:mod:`lightning_loco.codecs`): the payload then travels
encoded and is summed in float32 after decoding; without one (or with float32) it travels as it is.
The blocking forms are ``group_sum`` and ``all_reduce_sum``. Implementations:
:mod:`~lightning_loco.transport.torch_dist` (torch.distributed, gloo or NCCL) and
:mod:`~lightning_loco.transport.in_process` (N replicas in one process, for tests and studies).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from lightning_loco.codecs import Codec


class PeerError(RuntimeError):
    """An exchange with named peers failed (a peer stopped, or the network failed or timed out)."""


def peer_error(replica: int, peers: Sequence[int], ranks: Sequence[int], err: object) -> PeerError:
    return PeerError(
        f"Replica {replica} could not complete its exchange with replica(s) {list(peers)} "
        f"(global rank(s) {list(ranks)}): {err}. That peer stopped, or the network between you failed or "
        "timed out; look at its log for the cause."
    )


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

    def record(self, sent: int, received: int, seconds: float) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.seconds += seconds
        self.calls += 1


@runtime_checkable
class Pending(Protocol):
    """An exchange that has been posted and not yet waited for."""

    nbytes: int  # payload bytes this replica sends (and receives)
    peers: tuple[int, ...]  # the replicas it exchanges with
    wait_seconds: float  # time spent blocked in wait()
    seconds: float  # from posting to the end of wait()

    def done(self) -> bool:
        """Whether the sum is there (never blocks)."""
        ...

    def completed_after(self) -> Optional[float]:
        """Seconds from posting to completion, once ``done()`` (``None`` before)."""
        ...

    def wait(self) -> Tensor:
        """Blocks until the sum is there (raising :class:`PeerError` if it cannot come), records the
        traffic in the transport's stats, and returns the sum."""
        ...

    def watch(self) -> "Pending":
        """Lets ``done()`` see completion without anyone waiting (for exchanges left to run in the
        background; some backends need a thread for it). Returns self."""
        ...

    def abandon(self, timeout: float) -> bool:
        """Gives the exchange up to ``timeout`` seconds, then drops it; returns whether it finished."""
        ...

    @property
    def watcher(self) -> Optional[threading.Thread]:
        """A thread still waiting on the exchange's process group, if any (see ``abandon``)."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Moves flat float32 buffers between the replicas of one run."""

    replica: int  # this replica's index
    num_replicas: int
    stats: TransportStats

    def start_group_sum(self, payload: Tensor, group: Sequence[int], codec: Optional["Codec"] = None) -> Pending:
        """Posts the group's exchange; ``payload`` must not change until the sum has been waited for.
        The sum is a new tensor. Callers pass ``codec`` only when it is lossy."""
        ...

    def start_all_reduce_sum(self, payload: Tensor, codec: Optional["Codec"] = None) -> Pending:
        """Posts an all-reduce over every replica; the sum lands in ``payload``. With a lossy
        ``codec``: decoded chunks summed in float32, the same result on every replica."""
        ...

    def group_sum(self, payload: Tensor, group: Sequence[int], codec: Optional["Codec"] = None) -> Tensor:
        ...

    def all_reduce_sum(self, payload: Tensor, codec: Optional["Codec"] = None) -> Tensor:
        ...

    def resolved(self, total: Tensor, peers: tuple[int, ...] = ()) -> Pending:
        """An exchange that already completed (restored from a checkpoint): nothing to wait for."""
        ...
