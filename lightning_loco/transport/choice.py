"""Which float32 all-reduce a payload takes on gloo, chosen from what the first rounds measured
(``TorchDistributedTransport(all_reduce="auto")``, the default).

Two all-reduces give the same sum on every replica:

* ``"p2p"``, ours: with two replicas one pair exchange, with three or more our reduce-scatter and all-gather of
  point-to-point exchanges (:mod:`~lightning_loco.transport.chunked`): two steps, each about one round trip plus
  its bytes' time;
* ``"backend"``: gloo's own all-reduce (a ring of 2(N − 1) steps, each waiting a round trip).

Neither is faster everywhere. Ours wins where round trips dominate (N = 8 at 1 M floats on the 100 Mbit/s WAN:
0.54 × the ring's time) and at N = 4 on the WAN (0.89 ×); with eight replicas on a bandwidth-bound WAN, each
replica's seven flows at once lost to the ring's two in B7 (1.25–1.62 ×). So the transport measures.

**Trials.** Each payload (keyed by its optimizer, fragment and size) of 64 KiB or more takes the two in turn for
its first :data:`TRIALS` rounds (smaller ones, a few packets, keep the pair exchange with two replicas, one message
each way, and gloo's with more), and each replica notes the seconds from posting to the sum (what a caller waits
for, with or without overlap). **Agreement.** In the next round each replica sends the fastest time it saw of each to
every other one, in a message of two float64 posted before that round's payload (so it does not wait behind
it), and every replica sums the replicas' times in ascending replica order: bitwise the same totals everywhere,
so every replica takes the same decision when that round's sum lands (or, should the payload's next round be
posted first, before it): the all-reduce with the smaller total,
ours on a tie. From then on the payload takes it. The trials cost at most two rounds of the slower one; the
choice is made again after a resume or a heal (a new transport), and the summed bits depend on it (each
all-reduce adds in its own order): ``all_reduce="p2p"`` or ``"backend"`` fixes it.

Limits: the trial times run from posting to the sum, so with overlap they include the compute a round overlaps
(once an exchange is hidden the choice matters little); the decision is not revisited later in a run; gloo's side
of the trial is its all-reduce cut over the stream groups, and with eight replicas at 25 Mbit/s one ring whole was
faster than that (docs/benchmarks.md, B7), a candidate not tried yet.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ALL_REDUCES", "ALL_REDUCE_CHOICES", "BACKEND", "P2P", "TRIALS", "AllReduceChoice", "check_all_reduce",
           "post_times"]

P2P = "p2p"
BACKEND = "backend"
ALL_REDUCES = (P2P, BACKEND)
ALL_REDUCE_CHOICES = ("auto", P2P, BACKEND)
TRIALS = (P2P, BACKEND, P2P, BACKEND)
"""The all-reduces a payload's first rounds take, in turn: each twice, so a cold first round is not all it saw."""


def check_all_reduce(all_reduce: str, backend: str) -> None:
    """Refuses an unknown ``all_reduce``, and ``"p2p"`` where ours cannot run (any backend but gloo)."""
    if all_reduce not in ALL_REDUCE_CHOICES:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCE_CHOICES}, got {all_reduce!r}: 'auto' (chosen from "
                         "the first rounds' times), 'p2p' (ours, always) or 'backend' (the backend's own, always)")
    if all_reduce == P2P and backend != "gloo":
        raise ValueError(f"all_reduce='p2p' (our all-reduce of point-to-point messages) runs on gloo only; on "
                         f"{backend} the all-reduce is {backend}'s own (its channels and sockets): pass "
                         "all_reduce='auto' or 'backend'")


class AllReduceChoice:
    """One payload's trials and decision (pure logic: the transport posts and times; see the module docstring)."""

    def __init__(self, trials: tuple[str, ...] = TRIALS) -> None:
        if not trials or any(t not in ALL_REDUCES for t in trials):
            raise ValueError(f"trials must be a non-empty sequence of {ALL_REDUCES}, got {trials!r}")
        self.trials = trials
        self.posted = 0  # rounds posted for this payload
        self.seconds: dict[str, list[float]] = {a: [] for a in ALL_REDUCES}
        self.chosen: str | None = None
        self.totals: tuple[float, float] | None = None  # the replicas' summed fastest times, once agreed
        # posted and not yet waited for: this replica's times, the works, the receive buffers by replica
        self.sharing: tuple[Tensor, list[Any], dict[int, Tensor]] | None = None

    def next_round(self) -> tuple[str, bool]:
        """The all-reduce the next round takes, and whether it carries this replica's times (the agreement
        round, right after the trials); counts the round as posted."""
        round_ = self.posted
        self.posted += 1
        if self.chosen is not None:
            return self.chosen, False
        if round_ < len(self.trials):
            return self.trials[round_], False
        return P2P, round_ == len(self.trials)

    def record(self, algorithm: str, seconds: float) -> None:
        """A trial round's time, from posting to the sum (kept only before the decision)."""
        if self.chosen is None:
            self.seconds[algorithm].append(seconds)

    def mine(self) -> Tensor:
        """This replica's fastest time of each all-reduce (``inf`` for one it has not timed): what it sends."""
        return torch.tensor([min(self.seconds[a], default=math.inf) for a in ALL_REDUCES], dtype=torch.float64)

    def decide(self, by_replica: dict[int, Tensor]) -> str:
        """The decision from every replica's :meth:`mine` (this one's included), summed in ascending replica
        order: the same bits, and so the same decision, on every replica."""
        total = torch.zeros(len(ALL_REDUCES), dtype=torch.float64)
        for j in sorted(by_replica):
            total += by_replica[j]
        p2p, backend = (float(t) for t in total)
        self.totals = (p2p, backend)
        self.chosen = BACKEND if backend < p2p else P2P
        return self.chosen


def post_times(mine: Tensor, replica_ranks: list[int], me: int, group: Any) -> tuple[list[Any], dict[int, Tensor]]:
    """Posts this replica's times to every other replica's counterpart rank and a receive from each (gloo
    point-to-point over ``group``); returns the works and the receive buffers, keyed by replica."""
    received = {j: torch.empty_like(mine) for j in range(len(replica_ranks)) if j != me}
    ops = [dist.P2POp(dist.irecv, buf, replica_ranks[j], group) for j, buf in received.items()]
    ops += [dist.P2POp(dist.isend, mine, replica_ranks[j], group) for j in received]
    return (dist.batch_isend_irecv(ops) if ops else []), received
