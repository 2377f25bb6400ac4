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

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from lightning_loco.elastic.transport import ElasticPending

class PeerWork:
    """A posted operation with the partner it involves (``-1``: a collective over the membership).

    gloo's point-to-point works tell completion only to whoever waits on them, and a wait with a
    timeout of its own closes every connection of the group when it expires. So a member that must not
    wait past ``straggler_timeout`` has a thread wait on each operation (:meth:`watch`), with the group's
    own timeout, and looks at :meth:`finished`; waiting again is free (:meth:`wait`)."""

    def __init__(self, peer: int, work: Any) -> None:
        self.peer, self.work = peer, work
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        work = self.work  # None once a waiter saw it end
        return self._done.is_set() or work is None or bool(work.is_completed())

    # release: a gloo work holds its process group's connections open, so a group this replica aborts after
    # a failure closes them only once no work of it is referenced: an ended operation's work is let go at
    # once, and its error keeps no frames. Otherwise a partner that posts to this replica later (it does not
    # know the group broke) waits for its whole timeout instead of failing at once.

    def _wait_once(self) -> None:
        with self._lock:
            if not self._done.is_set():
                try:
                    self.work.wait()
                except RuntimeError as err:
                    self._error = err.with_traceback(None)  # its frames would hold this work (see release)
                self._done.set()
                self.work = None  # see release

    def watch(self) -> None:
        """Waits for the operation in a thread of its own (it ends with the operation, or its failure)."""
        threading.Thread(target=self._wait_once, name="lightning_loco-straggler", daemon=True).start()

    def finished(self, timeout: float) -> bool:
        """Whether the operation ended within ``timeout`` seconds (after :meth:`watch`)."""
        return self._done.wait(max(0.0, timeout))

    def wait(self) -> None:
        """Waits for the operation; a failure is a :class:`PeerFailed` naming the partner."""
        self._wait_once()
        if self._error is not None:
            raise PeerFailed([self.peer], self._error)


class PeerFailed(RuntimeError):
    """Operations with ``peers`` failed (``-1``: the collective)."""

    def __init__(self, peers: Sequence[int], error: BaseException) -> None:
        super().__init__(str(error))
        self.peers, self.error = list(peers), error


def wait_all(works: Sequence[PeerWork]) -> None:
    """Waits for every operation (the others' transfers still complete when one partner fails); raises
    :class:`PeerFailed` naming every partner whose operations failed."""
    failed: dict[int, BaseException] = {}
    for work in works:
        try:
            work.wait()
        except PeerFailed as err:
            failed.setdefault(work.peer, err.error)
    if failed:
        raise PeerFailed(sorted(failed), next(iter(failed.values())))


def settle(pending: "ElasticPending", timeout: float) -> tuple[bool, tuple[int, ...], bool]:
    """Decides the round of ``pending`` with its partners (see the module docstring). Returns whether the
    round is the group's, the partners it goes without, and whether this member gave up on them (True)
    or a partner gave up on this one (False). Raises :class:`PeerFailed` when a transfer failed."""
    transport, works = pending.transport, pending.works
    for work in works:
        work.watch()
    deadline = pending.started + timeout
    late = sorted({w.peer for w in works if not w.finished(deadline - time.perf_counter())})
    wait_all([w for w in works if w.peer not in late])  # an operation that ended may have failed
    partners = [j for j in pending.peers if j >= 0]
    on_time = not late
    said = torch.tensor([int(on_time)], dtype=torch.uint8, device=transport.device)
    heard = {j: torch.zeros(1, dtype=torch.uint8, device=transport.device) for j in partners}
    decisions = transport._exchange(dict.fromkeys(partners, said), heard, decision=True)
    if not on_time:  # the late partners' transfers and bytes complete when they reach this round
        for work in decisions:
            work.watch()
        transport.linger(works + decisions)
        return False, tuple(partners if -1 in late else late), True
    wait_all(decisions)
    gave_up = tuple(j for j in partners if int(heard[j].item()) == 0)
    return not gave_up, gave_up, False
