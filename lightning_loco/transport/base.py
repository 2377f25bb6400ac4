"""The interface between the outer-step driver and whatever moves buffers between replicas.

Two operations cover every algorithm:

* ``start_group_sum(payload, group)``: point to point inside one group (NoLoCo's groups, GASLoC's
  pairs). Every member ends with bitwise the same sum of the group's payloads, added in ascending
  replica order;
* ``start_all_reduce_sum(payload)``: one collective over all replicas (DiLoCo), summed in place.

Both post the operation and return a :class:`Pending` at once; ``Pending.wait()`` returns the sum.
Both take the round's identity (:class:`RoundId`: which outer step of which optimizer and fragment the
exchange belongs to; the elastic transport tags its messages with it) and an optional lossy ``codec``
(:mod:`lightning_loco.wire.codecs`): the payload then travels encoded and is summed in float32 after
decoding; without one (or with float32) it travels as it is. The blocking forms are ``group_sum`` and
``all_reduce_sum``. Implementations:
:mod:`~lightning_loco.transport.torch_dist` (torch.distributed, gloo or NCCL; its lossy wire formats in
:mod:`~lightning_loco.wire.coded`), :mod:`~lightning_loco.transport.in_process` (N replicas in one
process, for tests and studies) and :mod:`~lightning_loco.elastic.transport` (the members of an elastic
run).

A transport that moves buffers point to point between one rank and its counterparts in other replicas
declares it as :class:`PointToPoint` (slice, exchange, gather, pending): the lossy wire formats of
:mod:`~lightning_loco.wire.coded` are written against that protocol alone, so the float32
transport over torch.distributed and the elastic transport share them.

This module holds the interface and what every implementation shares: :class:`Pending` keeps the
posting time, the time ``wait()`` blocked, the sum once it is there and the traffic it records in the
transport's :class:`TransportStats`, so that a backend supplies only how to tell completion and how to
wait for it; :class:`Transport` gives the blocking forms once. A transport subclasses both (a class that
only has the methods is a ``Transport`` all the same).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from torch import Tensor
from typing_extensions import Self

from lightning_loco.wire.codecs import Codec


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


class Pending(ABC):
    """An exchange that has been posted and not yet waited for.

    ``done()`` never blocks; ``wait()`` blocks until the sum is there (raising :class:`PeerError` if it
    cannot come), records the traffic in the transport's stats once, and returns the sum, at once on
    later calls. A backend implements :meth:`_complete` (whether its operations finished) and
    :meth:`_receive` (wait for them and return the sum); it may override :meth:`watch`,
    :meth:`abandon` and :meth:`_counts`.
    """

    alone: bool = False
    """The round was finished without its partners (the elastic transport sets it when a partner
    failed); the driver reads it."""

    def __init__(self, transport: Any, nbytes: int, peers: tuple[int, ...]) -> None:
        self.transport = transport  # whose stats the traffic is recorded in
        self.nbytes = nbytes  # payload bytes this replica sends (and receives)
        self.peers = peers  # the replicas it exchanges with
        self.started = time.perf_counter()  # when it was posted
        self.wait_seconds = 0.0  # time spent blocked in wait()
        self.seconds = 0.0  # from posting to the end of wait()
        self.completed_at: Optional[float] = None  # when a watcher saw the operations complete
        self._result: Optional[Tensor] = None
        self._watcher: Optional[threading.Thread] = None
        # a static run's watch on peers whose fit ended (lightning_loco.replica.data_plan.PeerStops), if any
        self.peer_stops: Any = getattr(transport, "peer_stops", None)
        self.exchange_numbers: dict[int, int] = self.peer_stops.posted(peers) if self.peer_stops is not None else {}

    def completed_with(self, result: Tensor) -> Self:
        """Makes this an exchange that already completed with ``result`` (restored from a checkpoint):
        nothing to wait for, nothing more to count. Returns self, for each transport's ``resolved``."""
        self._result = result
        return self

    @property
    def watcher(self) -> Optional[threading.Thread]:
        """A thread still waiting on the exchange's process group, if any (see ``abandon``); ``None``
        unless the backend watches its operations with one (see ``watch``)."""
        return self._watcher

    def watch(self) -> Self:
        """Lets ``done()`` see completion without anyone waiting (for exchanges left to run in the
        background; some backends need a thread for it, the others see completion anyway). Returns
        self."""
        return self

    def done(self) -> bool:
        """Whether the sum is there (never blocks)."""
        return self._result is not None or self._complete()

    def completed_after(self) -> Optional[float]:
        """Seconds from posting to completion, once ``done()`` (``None`` before): exact when a watcher
        noted the moment, else until now."""
        if not self.done():
            return None
        end = self.completed_at if self.completed_at is not None else time.perf_counter()
        return end - self.started

    def wait(self) -> Tensor:
        """Blocks until the sum is there (raising :class:`PeerError` if it cannot come), records the
        traffic in the transport's stats, and returns the sum."""
        if self._result is not None:
            return self._result
        blocked = time.perf_counter()
        if self.peer_stops is not None:  # raises if a peer stopped without posting this exchange
            self.peer_stops.wait_for(self)
        result = self._receive()
        now = time.perf_counter()
        self.wait_seconds, self.seconds = now - blocked, now - self.started
        self._result = result
        if self._counts():
            self.transport.stats.record(self.nbytes, self.nbytes, self.seconds)
        return result

    def abandon(self, timeout: float) -> bool:
        """Gives the exchange up to ``timeout`` seconds, then drops it (training stops with a round in
        flight); returns whether it finished. By default it gets no time: whether it is done now."""
        return self.done()

    @abstractmethod
    def _complete(self) -> bool:
        """Whether the backend's operations have finished (never blocks; the sum is not there yet)."""

    @abstractmethod
    def _receive(self) -> Tensor:
        """Blocks until the backend's operations have finished and returns the sum (raising
        :class:`PeerError` if it cannot come). Called once, by ``wait()``."""

    def _counts(self) -> bool:
        """Whether the exchange is recorded in the stats once waited for: it talked to someone, and not
        alone."""
        return bool(self.peers) and not self.alone


@dataclass(frozen=True)
class RoundId:
    """The round an exchange belongs to: outer step ``outer_step`` (t) of optimizer ``optimizer``'s
    fragment ``fragment``. Every member of the round passes the same one."""

    outer_step: int
    optimizer: int = 0
    fragment: int = 0


FIRST_ROUND = RoundId(0)


@runtime_checkable
class Transport(Protocol):
    """Moves flat float32 buffers between the replicas of one run.

    Implementations subclass it for the blocking forms, ``start_*(...).wait()``. ``may_go_alone``: a
    transport that finishes rounds without partners who failed (the elastic one) says so; the driver
    then keeps what it needs to drop a collective round so finished (the error-feedback residual)."""

    replica: int  # this replica's index
    num_replicas: int
    stats: TransportStats
    may_go_alone: bool = False

    @property
    def slices_per_replica(self) -> int:
        """Into how many slices a payload is cut before it is encoded and sent (one per rank of a replica
        that moves its payload in slices; 1: whole). A lossy codec encodes each slice on its own."""
        return 1

    def start_group_sum(self, payload: Tensor, group: Sequence[int], codec: Optional[Codec] = None,
                        round_id: RoundId = FIRST_ROUND) -> Pending:
        """Posts the group's exchange; ``payload`` must not change until the sum has been waited for.
        The sum is a new tensor. Callers pass ``codec`` only when it is lossy."""
        ...

    def start_all_reduce_sum(self, payload: Tensor, codec: Optional[Codec] = None,
                             round_id: RoundId = FIRST_ROUND) -> Pending:
        """Posts an all-reduce over every replica; the sum lands in ``payload``. With a lossy
        ``codec``: decoded chunks summed in float32, the same result on every replica."""
        ...

    def resolved(self, total: Tensor, peers: tuple[int, ...] = ()) -> Pending:
        """An exchange that already completed (restored from a checkpoint): nothing to wait for."""
        ...

    def group_sum(self, payload: Tensor, group: Sequence[int], codec: Optional[Codec] = None,
                  round_id: RoundId = FIRST_ROUND) -> Tensor:
        """Posts the group's exchange and waits for the sum."""
        return self.start_group_sum(payload, group, codec, round_id).wait()

    def all_reduce_sum(self, payload: Tensor, codec: Optional[Codec] = None,
                       round_id: RoundId = FIRST_ROUND) -> Tensor:
        """Posts the all-reduce and waits for the sum (in ``payload``)."""
        return self.start_all_reduce_sum(payload, codec, round_id).wait()


class Work(Protocol):
    """A posted point-to-point operation (torch.distributed's ``Work``, or the elastic transport's)."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class PointToPoint(Protocol):
    """One rank's point-to-point exchanges with its counterparts in the other replicas: what the lossy
    wire formats (:mod:`~lightning_loco.wire.coded`) are written against.

    A replica may span several ranks; then each rank moves one slice of a payload (``slice``) with the
    same rank of its peers, and the replica's ranks put the summed slices together (``gather_slices``).
    Buffers cross the network on ``device``."""

    @property
    def device(self) -> Any:
        """Where buffers cross the network (a ``torch.device``)."""
        ...

    @property
    def replica(self) -> int: ...

    @property
    def num_replicas(self) -> int: ...

    @property
    def slices_per_replica(self) -> int:
        """How many slices a payload is cut into, one per rank of the replica (1: it moves whole)."""
        ...

    def slice(self, buf: Tensor) -> Tensor:
        """This rank's slice of a flat buffer (the whole buffer when it moves whole)."""
        ...

    def gather_slices(self, part: Tensor, like: Tensor) -> Tensor:
        """The whole buffer of ``like``'s shape from every rank's summed slice (``part`` itself when whole)."""
        ...

    def exchange(self, sends: dict[int, Tensor], receives: dict[int, Tensor], round_id: RoundId) -> list[Any]:
        """Posts the receives, then the sends, with replicas ``j`` of the keys (receives first: gloo runs the
        two directions of a pair one after the other otherwise); returns the posted operations."""
        ...

    def pending(self, works: list[Any], finish: Callable[[], Tensor], nbytes: int, peers: tuple[int, ...]) -> Pending:
        """The :class:`Pending` of posted ``works``: ``finish()`` makes the sum once they completed."""
        ...
