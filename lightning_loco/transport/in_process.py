"""N replicas in one process: the transport for driver tests, studies and the simulator.

``InProcessNetwork(n)`` stands for the wire; ``network.transport(i)`` is replica ``i``'s end. An
exchange is matched by its group and by how many exchanges that group has made before (every member
of a group takes part in each of its exchanges, so the counts agree), exactly as point-to-point
messages are matched in order. Sums are added in ascending replica order, as over torch.distributed,
so results are bitwise those of the real transport on the same payloads.

Replicas can run in lock-step in one thread (post every replica's round, then land them) or in
threads of their own (a blocking outer step then waits for its peers). Tests steer the wire:

* ``hold()`` / ``release()``: posted exchanges do not complete until released (a slow link);
* ``fail(j)``: replica ``j`` stops; exchanges with it raise :class:`PeerError` naming it;
* ``timeout``: how long ``wait()`` waits for a peer that never posts before raising ``PeerError``;
* ``delay``: seconds an exchange takes after its last member posted (a link's transfer time).

With a lossy ``codec`` (:mod:`lightning_loco.wire.codecs`) a group's sum is the sum of every member's
decoded payload and the all-reduce is :func:`~lightning_loco.wire.codecs.chunked_all_reduce`: bitwise what
the torch.distributed transport computes from the same payloads, with the bytes it would send.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

from torch import Tensor

from lightning_loco.transport.base import (
    FIRST_ROUND,
    PeerError,
    Pending,
    RoundId,
    Transport,
    TransportStats,
    peer_error,
    sum_in_group_order,
)
from lightning_loco.wire.codecs import Codec, all_reduce_bytes, chunked_all_reduce, decode_sum, ring_all_reduce_bytes


class InProcessNetwork:
    """The shared wire of ``num_replicas`` in-process replicas."""

    def __init__(self, num_replicas: int, timeout: float = 30.0, delay: float = 0.0) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.timeout = timeout
        self.delay = delay
        self._last_post: dict[tuple[Any, ...], float] = {}
        self._in_place: dict[tuple[Any, ...], dict[int, Tensor]] = {}
        self._combine: dict[tuple[Any, ...], Callable[[dict[int, Tensor], Sequence[int]], Tensor]] = {}
        self._cond = threading.Condition()
        self._posted: dict[tuple[Any, ...], dict[int, Tensor]] = {}
        self._held = False
        self._failed: set[int] = set()
        self.posts: list[tuple[int, tuple[int, ...]]] = []  # (replica, group) in posting order
        self.waits: list[tuple[int, tuple[int, ...]]] = []  # (replica, group) as each wait began

    def transport(self, replica: int) -> "InProcessTransport":
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica must be in [0, {self.num_replicas}), got {replica}")
        return InProcessTransport(self, replica)

    def hold(self) -> None:
        """Posted exchanges stay incomplete until :meth:`release`."""
        with self._cond:
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def fail(self, replica: int) -> None:
        """Replica ``replica`` stops: its peers' exchanges with it fail."""
        with self._cond:
            self._failed.add(replica)
            self._cond.notify_all()

    def _post(
        self, key: tuple[Any, ...], replica: int, payload: Tensor, group: tuple[int, ...], in_place: bool = False,
        combine: Optional[Callable[[dict[int, Tensor], Sequence[int]], Tensor]] = None,
    ) -> None:
        with self._cond:
            if combine is not None:
                self._combine[key] = combine
            self._posted.setdefault(key, {})[replica] = payload.detach().clone()
            self._last_post[key] = time.monotonic()
            self.posts.append((replica, group))
            if in_place:  # as a real all-reduce: the sum lands in every member's buffer when it completes
                self._in_place.setdefault(key, {})[replica] = payload
                if self._complete(key, group):
                    total = self.combined(key, group)
                    for buffer in self._in_place.pop(key).values():
                        buffer.copy_(total)
            self._cond.notify_all()

    def combined(self, key: tuple[Any, ...], group: Sequence[int]) -> Tensor:
        """The group's result from the posted buffers: their sum in ascending replica order, or the
        exchange's own combination (a lossy all-reduce)."""
        return self._combine.get(key, sum_in_group_order)(self._posted[key], group)

    def _complete(self, key: tuple[Any, ...], group: Sequence[int]) -> bool:
        if self._held or len(self._posted.get(key, ())) != len(group):
            return False
        return time.monotonic() >= self._last_post[key] + self.delay

    def _missing(self, key: tuple[Any, ...], group: Sequence[int]) -> list[int]:
        return [j for j in group if j not in self._posted.get(key, {})]


class InProcessPending(Pending):
    """One posted in-process exchange: its key on the wire, its group, and ``finish``, which turns the
    group's result into this replica's sum (see :class:`~lightning_loco.transport.base.Pending`)."""



    def __init__(
        self, transport: "InProcessTransport", key: tuple[Any, ...], group: tuple[int, ...],
        finish: Callable[[Tensor], Tensor], nbytes: int,
    ) -> None:
        super().__init__(transport, nbytes, tuple(j for j in group if j != transport.replica))
        self.key, self.group, self.finish = key, group, finish
        self.timeout: Optional[float] = None  # how long wait() waits for a peer that never posts (None: the network's)

    def _complete(self) -> bool:
        network = self.transport.network
        with network._cond:
            return network._complete(self.key, self.group)

    def _receive(self) -> Tensor:
        network, me = self.transport.network, self.transport.replica
        timeout = network.timeout if self.timeout is None else self.timeout
        with network._cond:
            network.waits.append((me, self.group))
            deadline = time.monotonic() + timeout
            while not network._complete(self.key, self.group):
                gone = [j for j in self.peers if j in network._failed]
                if gone or me in network._failed:
                    raise peer_error(me, gone or self.peers, gone or self.peers, "the peer stopped")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = network._missing(self.key, self.group) or list(self.peers)
                    raise peer_error(me, missing, missing, f"no answer within {timeout} s")
                network._cond.wait(min(remaining, 0.005) if network.delay else remaining)
            total = network.combined(self.key, self.group)
        return self.finish(total)

    def abandon(self, timeout: float) -> bool:
        self.timeout = timeout  # up to ``timeout``, not the network's (much longer) timeout
        try:
            self.wait()
            return True
        except PeerError:
            return False


class InProcessTransport(Transport):
    """Replica ``replica``'s end of an :class:`InProcessNetwork`."""

    def __init__(self, network: InProcessNetwork, replica: int) -> None:
        self.network = network
        self.replica = replica
        self.num_replicas = network.num_replicas
        self.stats = TransportStats()
        self._counts: dict[tuple[Any, ...], int] = {}

    def _key(self, kind: str, group: tuple[int, ...]) -> tuple[Any, ...]:
        base = (kind, group)
        count = self._counts.get(base, 0)
        self._counts[base] = count + 1
        return (*base, count)

    def start_group_sum(self, payload: Tensor, group: Sequence[int], codec: Optional[Codec] = None,
                        round_id: RoundId = FIRST_ROUND) -> InProcessPending:
        if self.replica not in group:
            raise ValueError(f"replica {self.replica} is not in the group {tuple(group)}")
        if self.replica in self.network._failed:
            raise peer_error(self.replica, [self.replica], [self.replica], "this replica stopped")
        members = tuple(sorted(group))
        key = self._key("group", members)
        if codec is not None and codec.lossy and len(members) > 1:  # each sends its encoded payload, as on the wire;
            def combine(encoded: dict[int, Tensor], group: Sequence[int]) -> Tensor:  # members sum every one decoded
                return decode_sum({j: encoded[j] for j in group}, payload.numel(), codec, group)

            self.network._post(key, self.replica, codec.encode(payload), members, combine=combine)
            nbytes = codec.nbytes(payload.numel()) * (len(members) - 1)
        else:
            self.network._post(key, self.replica, payload, members)
            nbytes = payload.numel() * payload.element_size() * (len(members) - 1)
        return InProcessPending(self, key, members, lambda total: total.to(payload.device), nbytes)

    def start_all_reduce_sum(self, payload: Tensor, codec: Optional[Codec] = None,
                             round_id: RoundId = FIRST_ROUND) -> InProcessPending:
        members = tuple(range(self.num_replicas))
        key = self._key("all", members)
        n = self.num_replicas
        if codec is not None and codec.lossy and n > 1:
            def combine(buffers: dict[int, Tensor], group: Sequence[int]) -> Tensor:
                return chunked_all_reduce([buffers[j] for j in sorted(group)], codec)

            self.network._post(key, self.replica, payload, members, in_place=True, combine=combine)
            nbytes = all_reduce_bytes(codec, payload.numel(), n, self.replica)
        else:
            self.network._post(key, self.replica, payload, members, in_place=True)
            nbytes = ring_all_reduce_bytes(payload.numel() * payload.element_size(), n)

        def finish(total: Tensor) -> Tensor:
            payload.copy_(total)
            return payload

        return InProcessPending(self, key, members, finish, nbytes)

    def resolved(self, total: Tensor, peers: tuple[int, ...] = ()) -> InProcessPending:
        return InProcessPending(self, ("resolved",), (self.replica, *peers), lambda t: t, 0).completed_with(total)
