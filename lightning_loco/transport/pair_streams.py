"""How many connections a pair exchange takes with ``streams="auto"``, learnt from the exchanges' own times.

A message cut by its size alone (:func:`~lightning_loco.transport.streams.auto_streams`, up to 8 pieces for 32 MB or
more) fills a long fat pipe, where one connection's send buffer covers a small part of bandwidth × round trip
(4.8 × faster than one connection on 1 Gbit/s, 100 ms one way). Where one connection's window already covers the
link, the extra flows only compete: on 100 Mbit/s, 50 ms one way, plain TCP over 8 connections took 1.19 × one's
time, and NoLoCo's 200 MB pair exchange over the size's 8 pieces 1.23 × its time over one
(``benchmarks/link_efficiency.py``, B7). Neither count is right on both links, so each replica measures.

**Per payload** (keyed by its optimizer, fragment and size, as the all-reduce choice is) a replica keeps the times of
its exchanges, from posting to the sum, by the count they took: ``"one"`` (one connection per peer) or ``"auto"``
(the size's count). Every pair exchange of a payload cut into more than one piece sends each peer, before the
payload on the main connection, one number: the count this replica proposes for the pair's *next* exchange of that
payload. It proposes the count it has fewer times of (two of each first, ``"auto"`` on a tie), then the faster one
(the smaller of each count's fastest time); a count already 1.5 × slower than the other at its first time is not
tried again.

**Agreement.** The two sides of a pair cut each message alike when they take the count from what both know: what
each proposed to the other at their last exchange of the payload. A pair's message takes one connection when both
proposed ``"one"``, and the size's count otherwise (their first exchange included). No message other than the pair's
own, no round trip added (the number travels in front of the payload), and nothing global: each pair decides from
its own last meeting, so with random pairs a replica's count settles as it meets each peer a second time. The sum is
bitwise the same for every count (the pieces land in the same buffer).

Costs: one or two exchanges at the slower count (the trials) per pair and payload, 8 bytes per message, and on a
link where one connection is right, each pair's first exchange at the size's count. Limits: a group's exchange takes
one time for all its peers (a time is kept only where every peer's message took the same count); with overlap the
times include the compute a round overlaps. A new transport (a resume) starts again. The chunked all-reduce (three
replicas or more), gloo's own and the lossy wire formats cut by size as before.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["AUTO_COUNT", "CLEAR", "ONE", "PAIR_TRIALS", "PairStreams"]

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
        has fewer times of until each has ``trials`` (posted ones counted; ``"auto"`` on a tie), then the faster."""
        have = {c: len(self.seconds[c]) + self.pending[c] + (c == now) for c in (ONE, AUTO_COUNT)}
        if min(have.values()) < self.trials and not self.clear():
            return ONE if have[ONE] < have[AUTO_COUNT] else AUTO_COUNT
        return self.preferred()

    def clear(self) -> bool:
        """Whether both counts have a time and one's fastest is at least :data:`CLEAR` times the other's (as one
        connection's on a long fat pipe, 4-5 × the size's count): the slower is not tried again."""
        one, auto = (min(self.seconds[c], default=math.inf) for c in (ONE, AUTO_COUNT))
        return max(one, auto) < math.inf and max(one, auto) >= CLEAR * min(one, auto)

    def preferred(self) -> str:
        """The faster count so far (each count's fastest time; ``"auto"`` where one is untimed or on a tie)."""
        one, auto = (min(self.seconds[c], default=math.inf) for c in (ONE, AUTO_COUNT))
        return ONE if one < auto else AUTO_COUNT

    def posted(self, now: Optional[str]) -> None:
        """An exchange at count ``now`` (None: mixed) was posted."""
        if now is not None:
            self.pending[now] += 1

    def landed(self, now: Optional[str], seconds: float, proposed: str, told: dict[int, Tensor]) -> None:
        """An exchange posted at count ``now`` landed after ``seconds``: its time is kept under its count, and what
        this replica ``proposed`` and each peer ``told`` it (their numbers, received) are the pairs' next counts."""
        if now is not None:
            self.pending[now] -= 1
            self.seconds[now].append(seconds)
        for peer, number in told.items():
            self.met[peer] = (proposed, decode(number))


def encode(proposal: str) -> Tensor:
    """The number a proposal travels as (one int64)."""
    return torch.tensor([_CODES[proposal]], dtype=torch.int64)


def decode(number: Tensor) -> str:
    """A received proposal; an unknown number (a peer of another version) counts as the size's count."""
    return _NAMES.get(int(number.item()), AUTO_COUNT)
