"""Host buffers for tensors that cross between a CUDA device and the CPU on the outer step's path.

A buffer of page-locked (pinned) host memory lets a device-to-host or host-to-device copy run as one
DMA transfer with ``non_blocking=True``; from a pageable buffer CUDA stages the copy itself, in
pieces, and blocks the host while it does. Pinned memory is slow to allocate, so a
:class:`StagingPool` keeps the buffers it handed out and, once they are given back, hands the same
ones out again for the same size and dtype: the outer steps of a run allocate once.

A buffer given back may still be read by a host-to-device copy that CUDA has queued but not yet run:
:meth:`StagingPool.give_back` records a CUDA event after the queued work, and :meth:`StagingPool.take`
waits for that event before handing the buffer out again (at the next outer step, when that copy
has long finished). A buffer that is not given back (an exchange abandoned while a peer may still
write into it) is simply dropped by the pool.

Without CUDA (``torch.cuda.is_available()`` false) nothing is pinned: pinning needs the CUDA driver.
The pool then hands out plain host buffers, reused all the same, and ``pinned`` is false.

Used by :mod:`~lightning_loco.driver.flat` (CUDA parameters, outer state on the CPU) and by
:mod:`~lightning_loco.transport.torch_dist` (CUDA payloads that cross gloo).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class StagingPool:
    """Reused host buffers, pinned when CUDA is available.

    Args:
        pin: pin the buffers (default: whether CUDA is available; pinning without CUDA fails).
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        # (numel, dtype) -> buffers given back, each with the event after its last queued use (or None)
        self._free: dict[tuple[int, torch.dtype], list[tuple[Tensor, Any]]] = {}
        self.allocations = 0  # buffers allocated so far; a buffer handed out again is not counted

    def take(self, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """A host buffer of ``numel`` elements of ``dtype``, nobody else's until given back: one given
        back earlier when there is one (after waiting for copies still queued out of it), else new."""
        free = self._free.get((numel, dtype))
        if free:
            buf, event = free.pop()
            if event is not None:
                event.synchronize()
            return buf
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, pin_memory=self.pinned)

    def give_back(self, *buffers: Tensor) -> None:
        """Returns buffers for reuse. Copies out of them may still be queued on the current CUDA
        stream: the next :meth:`take` of each waits for them."""
        event = None
        if self.pinned and buffers:
            event = torch.cuda.Event()
            event.record()
        for buf in buffers:
            self._free.setdefault((buf.numel(), buf.dtype), []).append((buf, event))

    def to_host(self, tensor: Tensor) -> Tensor:
        """A buffer of this pool holding ``tensor`` (flattened, same dtype), complete on return: one
        ``non_blocking`` copy, then a wait for it when it came from a CUDA device (whoever reads the
        buffer next, e.g. gloo's threads, does not follow CUDA streams)."""
        buf = self.take(tensor.numel(), tensor.dtype)
        buf.copy_(tensor.reshape(-1), non_blocking=self.pinned)
        if self.pinned and tensor.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            event.synchronize()
        return buf

    def to_device(self, host: Tensor, device: torch.device) -> Tensor:
        """A new tensor on ``device`` holding ``host``, copied with ``non_blocking`` (``host`` is a
        buffer of this pool: give it back after the call, not before)."""
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(host, non_blocking=self.pinned and out.device.type == "cuda")
        return out

    def clear(self) -> None:
        """Drops every buffer given back (after waiting for copies still queued out of them)."""
        for free in self._free.values():
            for _, event in free:
                if event is not None:
                    event.synchronize()
        self._free.clear()
