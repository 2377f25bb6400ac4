"""The operations of an exchange on a membership's process group, each with the partner it involves.

Every exchange of the elastic transport (:mod:`~lightning_loco.elastic.transport`) posts torchft gloo
operations and keeps each as a :class:`PeerWork`, so that a failure names the partner it came from
(:class:`PeerFailed`) and a late partner can be waited for with a bound of its own
(:mod:`~lightning_loco.elastic.straggler`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, Optional


class CollectivePeer(IntEnum):
    """The partner of an operation that is not with one member: a collective over the whole membership."""

    ALL = -1


class PeerWork:
    """A posted operation with the partner it involves (:attr:`CollectivePeer.ALL`: a collective).

    gloo's point-to-point works tell completion only to whoever waits on them, and a wait with a
    timeout of its own closes every connection of the group when it expires. So a member that must not
    wait past ``straggler_timeout`` has a thread wait on each operation (:meth:`watch`), with the group's
    own timeout, and looks at :meth:`finished`; waiting again is free (:meth:`wait`).

    A gloo work holds its process group's connections open, so a group this replica aborts after a
    failure closes them only once no work of it is referenced: an ended operation's work is let go at
    once, and its error keeps no frames. Otherwise a partner that posts to this replica later (it does not
    know the group broke) waits for its whole timeout instead of failing at once."""

    def __init__(self, peer: int, work: Any) -> None:
        self.peer, self.work = peer, work
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        work = self.work  # None once a waiter saw it end
        return self._done.is_set() or work is None or bool(work.is_completed())

    def _wait_once(self) -> None:
        with self._lock:
            if not self._done.is_set():
                try:
                    self.work.wait()
                except RuntimeError as err:
                    self._error = err.with_traceback(None)  # its frames would hold this work (see the class)
                self._done.set()
                self.work = None  # see the class docstring

    def watch(self) -> None:
        """Waits for the operation in a thread of its own (it ends with the operation, or its failure)."""
        threading.Thread(target=self._wait_once, name="lightning_loco-straggler", daemon=True).start()

    def finished(self, timeout: float) -> bool:
        """Whether the operation ended within ``timeout`` seconds (after :meth:`watch`)."""
        return self._done.wait(max(0.0, timeout))

    def succeeded(self, timeout: float) -> bool:
        """Whether the operation ended without failing within ``timeout`` seconds (after :meth:`watch`)."""
        return self.finished(timeout) and self._error is None

    def wait(self) -> None:
        """Waits for the operation; a failure is a :class:`PeerFailed` naming the partner."""
        self._wait_once()
        if self._error is not None:
            raise PeerFailed([self.peer], self._error)


class PeerFailed(RuntimeError):
    """Operations with ``peers`` failed (:attr:`CollectivePeer.ALL`: the collective)."""

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
