"""Waiting for an exchange posted over ``torch.distributed``: :class:`PendingSum` holds its works (gloo's or
NCCL's asynchronous operations) and how to make the sum once they completed.

Timing, stats and the kept sum are :class:`~lightning_loco.transport.base.Pending`'s; this module adds how to
tell completion and how to wait. On CPU transports a watcher thread waits for the works (gloo's point-to-point
works report completion only once waited for); on CUDA ones the works are waited for on the transport's side
stream and a CUDA event recorded there tells completion: no thread and no host synchronisation. The
transport that posts them is :class:`~lightning_loco.transport.torch_dist.TorchDistributedTransport`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor
from typing_extensions import Self

from lightning_loco.transport.base import PeerError, Pending

__all__ = ["PendingSum", "WorksTransport"]


class WorksTransport(Protocol):
    """What a :class:`PendingSum` asks of the transport that posted its works."""

    device: torch.device

    def completion_event(self, works: list[Any]) -> Any:
        """A CUDA event that completes after ``works``."""

    def peer_error(self, peers: Sequence[int], err: BaseException) -> PeerError:
        """The error that names the replicas an exchange failed with."""


class PendingSum(Pending):
    """An exchange posted by ``start_group_sum`` or ``start_all_reduce_sum``: its works, and ``finish``,
    which makes the sum once they completed (with k > 1, an all-gather inside the replica).

    ``wait()`` blocks at most the process group's timeout. ``watch()`` starts a thread that waits for
    the works and notes when they completed: gloo's point-to-point works report completion only once
    waited for, so without it ``done()`` could not tell a finished transfer from a running one. NCCL's
    works are never watched by a thread: on a CUDA transport the works are waited for on the
    transport's side stream at once, which only makes that stream wait, and a CUDA event recorded
    there after them tells completion (``done()`` queries it, ``wait()`` makes the current stream wait
    for it).
    """

    def __init__(
        self,
        transport: WorksTransport,
        works: list[Any],
        finish: Callable[[], Tensor],
        nbytes: int,
        peers: tuple[int, ...],
    ) -> None:
        super().__init__(transport, nbytes, peers)
        self.works, self.finish = works, finish
        self._posted = bool(works)  # a replica alone in an all-reduce still counts the call
        self._error: Optional[RuntimeError] = None
        self._event: Any | None = None  # CUDA transports: recorded on the side stream after the works
        if works and transport.device.type == "cuda":
            try:
                self._event = transport.completion_event(works)
            except RuntimeError as err:  # TORCH_NCCL_BLOCKING_WAIT=1: the works were waited for here
                raise transport.peer_error(peers, err) from err

    def watch(self) -> Self:
        """Starts the watcher thread (CPU transports only; see the class docstring). Returns self."""
        if self.works and self._watcher is None and self.transport.device.type == "cpu":
            self._watcher = threading.Thread(target=self._wait_works, name="lightning_loco-exchange", daemon=True)
            self._watcher.start()
        return self

    def _wait_works(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as err:
            self._error = err
        self.completed_at = time.perf_counter()

    def abandon(self, timeout: float) -> bool:
        """Gives the posted operations up to ``timeout`` seconds to finish, then drops them, whatever
        happened (used when training stops with a round in flight). Returns whether they finished."""
        finished = True
        if self._watcher is not None:
            self._watcher.join(timeout)
            finished = not self._watcher.is_alive() and self._error is None
        elif self._event is not None:  # poll: making the training stream wait could hang it
            deadline = time.perf_counter() + timeout
            while not self._event.query() and time.perf_counter() < deadline:
                time.sleep(0.01)
            finished = bool(self._event.query())
        else:
            for work in self.works:
                try:
                    finished = bool(work.wait(timedelta(seconds=timeout))) and finished
                except RuntimeError:
                    finished = False
        self.works, self.finish = [], lambda: torch.empty(0)
        return finished

    def _complete(self) -> bool:
        if self._watcher is not None:
            return not self._watcher.is_alive()
        if self._event is not None:
            return bool(self._event.query())
        return all(w.is_completed() for w in self.works)

    def _receive(self) -> Tensor:
        try:
            if self._watcher is not None:
                self._watcher.join()
                if self._error is not None:
                    raise self._error
            elif self._event is not None:
                torch.cuda.current_stream(self.transport.device).wait_event(self._event)
            else:
                for work in self.works:
                    work.wait()
            result = self.finish()
        except RuntimeError as err:
            raise self.transport.peer_error(self.peers, err) from err
        self.works, self.finish = [], lambda: result
        return result

    def _counts(self) -> bool:
        return bool(self.peers) or self._posted  # a group of one talks to nobody: nothing to count
