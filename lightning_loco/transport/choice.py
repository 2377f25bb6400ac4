"""Which float32 all-reduce a payload takes on gloo, chosen from what the first rounds measured
(``TorchDistributedTransport(all_reduce="auto")``, the default).

These all-reduces give the same sum on every replica:

* ``"p2p"``, ours: with two replicas one pair exchange, with three or more our reduce-scatter and all-gather of
  point-to-point exchanges (:mod:`~lightning_loco.transport.chunked`): two steps, each about one round trip plus
  its bytes' time;
* ``"backend"``: gloo's own all-reduce (a ring of 2(N − 1) steps, each waiting a round trip), cut over the
  transport's stream groups as the payload's pieces are (one ring per group, all at once);
* ``"backend_whole"``: gloo's all-reduce of the whole payload on the one main connection (tried only where the
  payload is cut into more than one piece; otherwise it is ``"backend"``).

None is faster everywhere. Ours wins where round trips dominate (N = 8 at 1 M floats on the 100 Mbit/s WAN:
0.54 × the ring's time) and at N = 4 on the WAN (0.89 ×); with eight replicas on a bandwidth-bound WAN, each
replica's seven flows at once lost to the ring's two in B7 (1.25–1.62 ×); at 25 Mbit/s with eight replicas
eight rings at once took 1.11 × one ring (B7). So the transport measures.

**Trials.** Each payload (keyed by its optimizer, fragment and size) of 64 KiB or more takes the candidates in turn
for its first rounds, each twice (:data:`TRIALS`, or :data:`TRIALS_CUT` where the payload is cut into pieces;
smaller ones, a few packets, keep the pair exchange with two replicas, one message each way, and gloo's with more),
and each replica notes the seconds from posting to the sum (what a caller waits for, with or without overlap).
**Agreement.** In the next round each replica sends the fastest time it saw of each to every other one, in a
message of float64 (one per all-reduce in :data:`ALL_REDUCES`) posted before that round's payload (so it does not
wait behind it), and every replica sums the replicas' times in ascending replica order: bitwise the same totals
everywhere, so every replica takes the same decision when that round's sum lands (or, should the payload's next
round be posted first, before it): the all-reduce with the smallest total, the earlier in :data:`ALL_REDUCES` on a
tie (ours first). From then on the payload takes it. The cost: the trial rounds of slower candidates (at most
four), the round that carries the times, and with overlap the round posted before the decision lands (both take
ours). The choice is made again after a resume or a heal (a new transport), and the summed bits depend on it (each
all-reduce adds in its own order): ``all_reduce="p2p"``, ``"backend"`` or ``"backend_whole"`` fixes it.

Limits: the trial times run from posting to the sum, so with overlap they include the compute a round overlaps
(once an exchange is hidden the choice matters little); the decision is not revisited later in a run.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ALL_REDUCES", "ALL_REDUCE_CHOICES", "BACKEND", "BACKEND_WHOLE", "P2P", "TRIALS", "TRIALS_CUT",
           "AllReduceChoice", "check_all_reduce", "post_times", "trials_for"]

P2P = "p2p"
BACKEND = "backend"
BACKEND_WHOLE = "backend_whole"
ALL_REDUCES = (P2P, BACKEND, BACKEND_WHOLE)
"""The candidates, in the order of the times a replica sends and of preference on a tie."""
ALL_REDUCE_CHOICES = ("auto", P2P, BACKEND, BACKEND_WHOLE)
TRIALS = (P2P, BACKEND, P2P, BACKEND)
"""The all-reduces a payload's first rounds take, in turn: each twice, so a cold first round is not all it saw."""
TRIALS_CUT = (P2P, BACKEND, BACKEND_WHOLE, P2P, BACKEND, BACKEND_WHOLE)
"""The same for a payload cut into several pieces, where gloo's all-reduce whole differs from it cut."""


def trials_for(pieces: int) -> tuple[str, ...]:
    """The trials of a payload cut into ``pieces`` pieces (the same on every replica: it depends on the size)."""
    return TRIALS_CUT if pieces > 1 else TRIALS


def check_all_reduce(all_reduce: str, backend: str) -> None:
    """Refuses an unknown ``all_reduce``, and ``"p2p"`` where ours cannot run (any backend but gloo)."""
    if all_reduce not in ALL_REDUCE_CHOICES:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCE_CHOICES}, got {all_reduce!r}: 'auto' (chosen from "
                         "the first rounds' times), 'p2p' (ours, always), 'backend' (the backend's own, always, cut "
                         "over the stream groups) or 'backend_whole' (the backend's own on one connection, always)")
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
        self.last_was_trial = False  # whether the round next_round gave last is a trial (its time is recorded)
        self.seconds: dict[str, list[float]] = {a: [] for a in ALL_REDUCES}
        self.chosen: str | None = None
        self.totals: tuple[float, ...] | None = None  # the replicas' summed fastest times, once agreed
        # posted and not yet waited for: this replica's times, the works, the receive buffers by replica
        self.sharing: tuple[Tensor, list[Any], dict[int, Tensor]] | None = None

    def next_round(self) -> tuple[str, bool]:
        """The all-reduce the next round takes, and whether it carries this replica's times (the agreement
        round, right after the trials); counts the round as posted."""
        round_ = self.posted
        self.posted += 1
        self.last_was_trial = self.chosen is None and round_ < len(self.trials)
        if self.chosen is not None:
            return self.chosen, False
        if round_ < len(self.trials):
            return self.trials[round_], False
        return P2P, round_ == len(self.trials)

    def record(self, algorithm: str, seconds: float) -> None:
        """A trial round's time, from posting to the sum (kept only before the decision). The transport records
        the rounds :meth:`next_round` gave as trials (``last_was_trial`` when it was called), not the round that
        carries the times nor those after it."""
        if self.chosen is None:
            self.seconds[algorithm].append(seconds)

    def mine(self) -> Tensor:
        """This replica's fastest time of each all-reduce (``inf`` for one it has not timed): what it sends."""
        return torch.tensor([min(self.seconds[a], default=math.inf) for a in ALL_REDUCES], dtype=torch.float64)

    def settle(self, me: int, peer_error: Callable[[list[int], BaseException], BaseException]) -> None:
        """Waits for the replicas' times, once posted, and decides (nothing to do before they are posted or after);
        a failed receive raises ``peer_error(peers, err)``."""
        if self.sharing is None:
            return
        mine, works, received = self.sharing
        try:
            for work in works:
                work.wait()
        except RuntimeError as err:
            raise peer_error(sorted(received), err) from err
        self.sharing = None
        self.decide({**received, me: mine})

    def decide(self, by_replica: dict[int, Tensor]) -> str:
        """The decision from every replica's :meth:`mine` (this one's included), summed in ascending replica
        order: the same bits, and so the same decision, on every replica."""
        total = torch.zeros(len(ALL_REDUCES), dtype=torch.float64)
        for j in sorted(by_replica):
            total += by_replica[j]
        totals = self.totals = tuple(float(t) for t in total)
        best = min(range(len(ALL_REDUCES)), key=lambda i: (totals[i], i))  # inf == inf: the earlier one
        self.chosen = ALL_REDUCES[best]
        return self.chosen


def post_times(mine: Tensor, replica_ranks: list[int], me: int, group: Any) -> tuple[list[Any], dict[int, Tensor]]:
    """Posts this replica's times to every other replica's counterpart rank and a receive from each (gloo
    point-to-point over ``group``); returns the works and the receive buffers, keyed by replica."""
    received = {j: torch.empty_like(mine) for j in range(len(replica_ranks)) if j != me}
    ops = [dist.P2POp(dist.irecv, buf, replica_ranks[j], group) for j, buf in received.items()]
    ops += [dist.P2POp(dist.isend, mine, replica_ranks[j], group) for j in received]
    return (dist.batch_isend_irecv(ops) if ops else []), received
