"""How many connections a pair exchange takes with ``streams="auto"``, learnt from the exchanges' own times
(:class:`PairStreams`, pure logic; :func:`post_proposals`, what the torch.distributed transport posts).

A message cut by its size alone (:func:`~lightning_loco.transport.streams.auto_streams`, up to 8 pieces for 32 MB or
more) fills a long fat pipe, where one connection's send buffer covers a small part of bandwidth × round trip
(4.8 × faster than one connection on 1 Gbit/s, 100 ms one way). Where one connection's window already covers the
link, the extra flows only compete: on 100 Mbit/s, 50 ms one way, plain TCP over 8 connections took 1.19 × one's
time, and NoLoCo's 200 MB pair exchange over the size's 8 pieces 1.23 × its time over one
(``benchmarks/link_efficiency.py``, B7). Neither count is right on both links, so each replica measures.

**Per payload** (keyed by its optimizer, fragment and size, as the all-reduce choice is) a replica keeps the times of
its exchanges, from posting to completion (as a watcher saw it, or to the wait that found it done), by the count they
took: ``"one"`` (one connection per peer) or ``"auto"`` (the size's count). Every pair exchange of a payload cut into
more than one piece sends each peer, before the payload on the main connection, one number: the count this replica
proposes for the pair's *next* exchange of that payload. It proposes the count it has fewer exchanges of (``"auto"``
on a tie) until each has two, then the faster one by the times landed so far (the smaller of each count's fastest
time). The first exchange takes the size's count, the second one connection; where one connection's first time is
already 1.5 × the size's count's (a long fat pipe: 4-5 ×), it is not tried again.

**Agreement.** The two sides of a pair cut each message alike when they take the count from what both know: what
each proposed to the other at their last exchange of the payload, in posting order (a replica waits for the
proposals of its earlier exchanges, which travel ahead of their payloads, before it posts the next). A pair's message
takes one connection when both proposed ``"one"``, and the size's count otherwise (their first exchange included).
No message other than the pair's own, no round trip added, and nothing global: each pair decides from its own last
meeting, so with random pairs a replica's count settles as it meets each peer a second time. The sum is bitwise the
same for every count (the pieces land in the same buffer).

Costs: one or two exchanges at the slower count (the trials) per pair and payload, 8 bytes per message, and on a
link where one connection is right, each pair's first exchange at the size's count. Limits: a group's exchange takes
one time for all its peers (a time is kept only where every peer's message took the same count); an overlapped
exchange is timed to its completion where a watcher saw it (the driver watches overlapped rounds), else to its
landing, steps it overlapped included; once settled a pair's count is not revisited; a new transport (a resume)
starts again. Gloo only (NCCL has its own sockets); the chunked all-reduce (three replicas or more), gloo's own and
the lossy wire formats cut by size as before.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AUTO_COUNT", "CLEAR", "ONE", "PAIR_TRIALS", "PairStreams", "decode", "encode", "post_proposals"]

ONE = "one"
AUTO_COUNT = "auto"
_CODES = {ONE: 1, AUTO_COUNT: 2}
_NAMES = {code: name for name, code in _CODES.items()}
PAIR_TRIALS = 2
"""The times of each count a replica proposes to take before it proposes the faster one."""
CLEAR = 1.5
"""Where one count's fastest time is this many times the other's, the trials end early: the faster is proposed."""


class PairStreams:
    """One payload's pair counts (pure logic: the transport posts, times and waits; see the module docstring)."""

    def __init__(self, trials: int = PAIR_TRIALS) -> None:
        if trials < 1:
            raise ValueError(f"trials must be >= 1, got {trials}")
        self.trials = trials
        self.seconds: dict[str, list[float]] = {ONE: [], AUTO_COUNT: []}
        self.pending: dict[str, int] = {ONE: 0, AUTO_COUNT: 0}  # posted, not yet timed
        # per peer, from the pair's last exchange: (what this replica proposed, what the peer proposed)
        self.met: dict[int, tuple[str, str]] = {}
        # the proposals of exchanges posted and not yet taken into met: (number, works, proposed, each peer's)
        self.unsettled: list[tuple[int, list[Any], str, dict[int, Tensor]]] = []
        self.exchanges = 0  # posted so far

    def count(self, peer: int, by_size: int) -> int:
        """The pieces of this replica's messages to and from ``peer`` in their exchange now: one where both proposed
        one connection at their last exchange, else ``by_size``. The peer computes the same."""
        return 1 if self.met.get(peer) == (ONE, ONE) else by_size

    def taken(self, counts: list[int]) -> Optional[str]:
        """The count an exchange with these per-peer counts took, or None where its peers' messages differ (the
        exchange's time then says nothing of either)."""
        if not counts or any(c != counts[0] for c in counts):
            return None
        return ONE if counts[0] == 1 else AUTO_COUNT

    def proposal(self, now: Optional[str]) -> str:
        """What this replica proposes for its peers' next exchange, given the count ``now`` being posted: the one it
        has fewer exchanges of (posted ones and this one counted; ``"auto"`` on a tie) until each has ``trials``, then
        the faster by the times landed so far."""
        have = {c: len(self.seconds[c]) + self.pending[c] + (c == now) for c in (ONE, AUTO_COUNT)}
        if min(have.values()) < self.trials and not self.clear():
            return ONE if have[ONE] < have[AUTO_COUNT] else AUTO_COUNT
        return self.preferred()

    def clear(self) -> bool:
        """Whether both counts have a time and one's fastest is at least :data:`CLEAR` times the other's (as one
        connection's on a long fat pipe, 4-5 × the size's count): the trials end, the faster is proposed."""
        one, auto = (min(self.seconds[c], default=math.inf) for c in (ONE, AUTO_COUNT))
        return max(one, auto) < math.inf and max(one, auto) >= CLEAR * min(one, auto)

    def preferred(self) -> str:
        """The count with the smaller fastest time so far (``"auto"`` on a tie, or where neither has a time). Only
        the preferred count gets new times, and its fastest can only fall: once settled, a pair keeps its count."""
        one, auto = (min(self.seconds[c], default=math.inf) for c in (ONE, AUTO_COUNT))
        return ONE if one < auto else AUTO_COUNT

    def posted(self, now: Optional[str], works: list[Any], proposed: str, told: dict[int, Tensor]) -> int:
        """An exchange at count ``now`` (None: mixed) was posted, with this replica's ``proposed`` count sent to its
        peers and their numbers to come into ``told`` through ``works`` (see :meth:`settle`). Returns its number."""
        if now is not None:
            self.pending[now] += 1
        self.exchanges += 1
        self.unsettled.append((self.exchanges, works, proposed, told))
        return self.exchanges

    def settle(self, through: Optional[int] = None) -> None:
        """Waits for the proposals of the exchanges posted so far (or up to number ``through``), in posting order, and
        takes each as its pairs' last exchange. Each came ahead of its payload, so an exchange that landed has its
        proposals there. Called before an exchange is posted, so a pair's count never depends on which of its earlier
        exchanges were waited for: only on those posted, the same on both sides of the pair."""
        while self.unsettled and (through is None or self.unsettled[0][0] <= through):
            _, works, proposed, told = self.unsettled[0]
            for work in works:
                work.wait()
            self.unsettled.pop(0)
            for peer, number in told.items():
                self.met[peer] = (proposed, decode(number))

    def landed(self, now: Optional[str], seconds: float) -> None:
        """An exchange posted at count ``now`` took ``seconds`` from posting to completion: kept under its count."""
        if now is not None:
            self.pending[now] -= 1
            self.seconds[now].append(seconds)


def encode(proposal: str) -> Tensor:
    """The number a proposal travels as (one int64)."""
    return torch.tensor([_CODES[proposal]], dtype=torch.int64)


def decode(number: Tensor) -> str:
    """A received proposal; a number that is neither counts as the size's count."""
    return _NAMES.get(int(number.item()), AUTO_COUNT)


def post_proposals(transport: Any, send: Tensor, others: list[int], round_id: Any
                   ) -> tuple[Optional[dict[int, int]], Optional[Callable[[Any], Any]]]:
    """For a ``TorchDistributedTransport`` with ``streams="auto"`` on gloo, and a message ``send`` the size would
    cut: each peer's count, learnt per pair, with this replica's proposal posted to each peer and theirs received,
    before the payload on the main connection; and what to give the exchange's pending once posted (it returns the
    pending, whose sum, once its operations completed, first keeps the exchange's time and takes its proposals,
    already there). Otherwise None and None."""
    by_size = transport.pieces(send)
    if not transport.auto_streams or by_size == 1 or transport.device.type != "cpu":
        return None, None
    key = (round_id.optimizer, round_id.fragment, send.numel())
    learnt = transport.pair_streams.setdefault(key, PairStreams())
    try:  # the proposals of this payload's earlier exchanges, in posting order: the same on both sides
        learnt.settle()
    except RuntimeError as err:
        raise transport.peer_error(sorted(others), err) from err
    counts = {j: learnt.count(j, by_size) for j in others}
    now = learnt.taken(list(counts.values()))
    proposed = learnt.proposal(now)
    mine = encode(proposed)
    told = {j: torch.empty_like(mine) for j in others}
    ranks, group = transport.replica_ranks, transport.process_group
    ops = [dist.P2POp(dist.irecv, told[j], ranks[j], group) for j in others]
    ops += [dist.P2POp(dist.isend, mine, ranks[j], group) for j in others]
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as err:
        raise transport.peer_error(sorted(others), err) from err
    number = learnt.posted(now, works, proposed, told)

    def learning(pending: Any) -> Any:
        finish = pending.finish

        def landed() -> Tensor:  # the works completed: the exchange's time, its proposals, then the sum
            end = pending.completed_at if pending.completed_at is not None else time.perf_counter()
            learnt.landed(now, end - pending.started)
            learnt.settle(through=number)  # not a later exchange's: its peer may not have posted it yet
            return finish()

        pending.finish = landed
        return pending

    return counts, learning
