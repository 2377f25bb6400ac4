"""Rounds with a late partner (``straggler_timeout``): who takes the round together, decided alike by all.

Without a straggler timeout an exchange waits for every partner up to ``outer_step_timeout``, past which
the partner counts as failed. With one, a live partner that is merely late is left out of that round
only, and nobody stops:

1. each member waits for its exchange's transfers up to ``straggler_timeout`` from its own posting;
2. it then tells each partner of the round (DiLoCo: every member) one byte: 1 if all its transfers
   completed in time, 0 if not, and posts a receive for each partner's byte;
3. a member that said 0 takes the round alone (DiLoCo: drops it) at once, without waiting for anyone;
   its transfers and bytes stay posted and complete when the late partner reaches the round;
4. a member that said 1 waits for every partner's byte: all 1, the round is the group's; any 0, it takes
   the round alone too (DiLoCo: drops it).

So a round is the group's on all its members or on none: the late member gets its partners' payloads at
once (they were posted long ago), says 1, reads their 0 and takes the round alone as well; it never waits
on a partner that gave up. Everyone counts the round, so the round counts stay agreed, and the late
member meets its partners again in the next round. Nobody aborts the membership's process group: that
is kept for failures (:mod:`~lightning_loco.elastic.transport`). The cost on the healthy path is one
byte per partner and its latency, once the payloads are in.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lightning_loco.elastic.works import CollectivePeer, PeerWork, wait_all
from lightning_loco.transport.base import RoundId


class Decides(Protocol):
    """What :func:`settle` needs of the elastic transport: one more exchange of the round (the decision
    bytes), and a place to keep operations a late partner completes later."""

    device: Any  # torch.device

    def exchange(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor], round_id: RoundId,
                 decision: bool = False) -> list[PeerWork]: ...

    def linger(self, works: Sequence[PeerWork]) -> None: ...


def settle(transport: Decides, works: Sequence[PeerWork], peers: Sequence[int], started: float, round_id: RoundId,
           timeout: float) -> tuple[bool, tuple[int, ...], bool]:
    """Decides round ``round_id`` with its partners ``peers`` (see the module docstring), whose transfers
    ``works`` were posted at ``started`` (``time.perf_counter``). Returns whether the round is the group's,
    the partners it goes without, and whether this member gave up on them (True) or a partner gave up on
    this one (False). Raises :class:`~lightning_loco.elastic.works.PeerFailed` when a transfer failed."""
    for work in works:
        work.watch()
    deadline = started + timeout
    late = sorted({w.peer for w in works if not w.finished(deadline - time.perf_counter())})
    wait_all([w for w in works if w.peer not in late])  # an operation that ended may have failed
    partners = [j for j in peers if j != CollectivePeer.ALL]
    on_time = not late
    said = torch.tensor([int(on_time)], dtype=torch.uint8, device=transport.device)
    heard = {j: torch.zeros(1, dtype=torch.uint8, device=transport.device) for j in partners}
    decisions = transport.exchange(dict.fromkeys(partners, said), heard, round_id, decision=True)
    if not on_time:  # the late partners' transfers and bytes complete when they reach this round
        for work in decisions:
            work.watch()
        transport.linger([*works, *decisions])
        return False, tuple(partners if CollectivePeer.ALL in late else late), True
    wait_all(decisions)
    gave_up = tuple(j for j in partners if int(heard[j].item()) == 0)
    return not gave_up, gave_up, False
