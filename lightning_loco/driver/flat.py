"""A fixed list of parameters seen as one flat float32 vector.

The outer step works on flat buffers: one buffer travels per outer step (not one message per
parameter), and the outer state (anchors, momenta) is kept in float32 whatever the parameters'
dtype, because bf16 pseudo-gradients lose most of their bits.

With the outer state on the CPU and the parameters on a CUDA device (``outer_state_device="cpu"``),
``gather`` and ``scatter`` go through one pinned host buffer, reused at every outer step: the
parameters are copied with ``non_blocking`` copies and the host waits once per call, not once per
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_loco.transport.staging import StagingPool


class FlatParameters:
    """Copies a fixed list of parameters into and out of one flat float32 vector.

    Args:
        params: the parameters, in a fixed order (the order defines the layout of the buffer).
        device: where the flat copies live (the outer-state device).
    """

    def __init__(self, params: Iterable[Tensor], device: torch.device | str) -> None:
        self.params: list[Tensor] = list(params)
        self.device = torch.device(device)
        tensors = self._tensors()
        self.shapes: list[torch.Size] = [p.shape for p in tensors]
        self.numels: list[int] = [p.numel() for p in tensors]
        self.offsets: list[int] = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.staging = StagingPool()  # used when the parameters are on CUDA and the flat copies are not

    # Tests set this to send CPU parameters through the staging buffer too (the path of CUDA
    # parameters), since a machine without CUDA has no other way to run it.
    stage_cpu_params = False

    def _tensors(self) -> list[Tensor]:
        """The tensors copied into and out of the flat vector: the parameters themselves."""
        return self.params

    def _staged(self) -> bool:
        """Whether copies go through the staging buffer: the flat copies live on the CPU and the
        parameters on a CUDA device."""
        return self.device.type == "cpu" and (
            self.stage_cpu_params or any(p.device.type == "cuda" for p in self.params)
        )

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def gather(self) -> Tensor:
        """A new float32 vector holding the current values of the parameters."""
        if self._staged():
            return self._gather_staged()
        out = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for p, a, b in zip(self._tensors(), self.offsets, self.offsets[1:]):
                out[a:b].copy_(p.detach().reshape(-1))
        return out

    def _gather_staged(self) -> Tensor:
        """CUDA parameters into a new host vector: ``non_blocking`` copies into the pinned buffer
        (each parameter cast to float32 on its device first), one wait, one host copy out."""
        staged = self.staging.take(self.numel)
        with torch.no_grad():
            for p, a, b in zip(self._tensors(), self.offsets, self.offsets[1:]):
                staged[a:b].copy_(p.detach().reshape(-1).float(), non_blocking=self.staging.pinned)
        if self.staging.pinned:
            torch.cuda.synchronize()  # the copies of every device the parameters are on
        out = staged.clone()
        self.staging.give_back(staged)
        return out

    def scatter(self, flat: Tensor) -> None:
        """Writes ``flat`` into the parameters (cast to each parameter's dtype and device)."""
        if flat.numel() != self.numel:
            raise ValueError(f"expected a flat buffer of {self.numel} elements, got {flat.numel()}")
        staged = None
        if self._staged() and flat.device.type == "cpu":
            staged = self.staging.take(self.numel)  # waits for the copies queued out of it last time
            staged.copy_(flat)
            flat = staged
        with torch.no_grad():
            for p, shape, a, b in zip(self._tensors(), self.shapes, self.offsets, self.offsets[1:]):
                p.copy_(flat[a:b].view(shape), non_blocking=staged is not None and self.staging.pinned)
        if staged is not None:
            self.staging.give_back(staged)  # the copies may still be queued: its next use waits for them

    def views(self, flat: Tensor) -> list[Tensor]:
        """Views of ``flat`` shaped like each parameter (they share ``flat``'s storage)."""
        return [flat[a:b].view(shape) for shape, a, b in zip(self.shapes, self.offsets, self.offsets[1:])]


class ShardedParameters(FlatParameters):
    """:class:`FlatParameters` over this rank's local shards of FSDP2's ``DTensor`` parameters
    (plain tensors among them are taken whole).

    The local shards are looked up at every copy (``to_local()`` is a view of the shard FSDP2 keeps),
    never cached: FSDP2 may swap a parameter's local tensor when it initialises lazily.

    Args:
        params: the parameters (``DTensor`` or plain), in a fixed order.
        device: where the flat copies live.
        after_scatter: called after new values were written: FSDP2 must drop the unsharded copies it
            may still hold (after a forward without backward), so that the next forward gathers the
            new shards.
    """

    def __init__(
        self, params: Iterable[Tensor], device: torch.device | str, after_scatter: Optional[Callable[[], None]] = None
    ) -> None:
        self.after_scatter = after_scatter
        super().__init__(params, device)

    def _tensors(self) -> list[Tensor]:
        return [p.to_local() if isinstance(p, DTensor) else p for p in self.params]

    def scatter(self, flat: Tensor) -> None:
        super().scatter(flat)
        if self.after_scatter is not None:
            self.after_scatter()

