"""Counting reads of tensor values to the host, for tests and checks of "no host synchronisation".

On a CUDA tensor every read of a value to the host (``Tensor.item``, ``tolist``, ``cpu``, ``numpy``,
``bool``/``float``/``int``/``index`` of a tensor) makes the host wait for the device. The driver's
per-step hook must do none of them between outer steps; :class:`HostReadCounter` counts them where
a CPU run can count them too (the GPU check's part 2 and ``tests/test_gpu_check.py``).

The counter replaces those methods of ``torch.Tensor`` while it is installed: it is tooling for a
test or a check, never for training.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class HostReadCounter:
    """Counts reads of tensor values to the host while active (see the module docstring).
    ``device_type``: count only tensors on that device type (None: all). ``where`` keeps the first
    20 places that read, as ``file:line`` outside torch."""

    active = False

    def __init__(self, device_type: Optional[str] = None) -> None:
        self.device_type = device_type
        self.count = 0
        self.where: list[str] = []
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        """Puts the counting methods on ``torch.Tensor`` (they count only while ``active``)."""
        import torch

        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))

    def uninstall(self) -> None:
        """Puts ``torch.Tensor``'s own methods back."""
        import torch

        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Any) -> Any:
        counter = self

        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if counter.active and (counter.device_type is None or tensor.device.type == counter.device_type):
                counter.count += 1
                if len(counter.where) < 20:
                    counter.where.append(f"Tensor.{name} at {_caller()}")
            return original(tensor, *args, **kwargs)

        return counted

    @contextmanager
    def counting(self) -> Iterator[HostReadCounter]:
        """Installed and active inside the ``with`` block, uninstalled after it (also on an error)."""
        self.install()
        self.active = True
        try:
            yield self
        finally:
            self.active = False
            self.uninstall()


def _caller() -> str:
    """The first frame outside this file and torch: where a host read came from."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and f"{os.sep}torch{os.sep}" not in path:
            return f"{Path(path).name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def rounds_seen(owner: Any) -> tuple[int, int]:
    """(rounds started, rounds landed) of a strategy or a driver: a step that changes either is an
    outer step (with ``overlap_steps`` a round lands τ steps after it started)."""
    landed = getattr(owner, "outer_step_reports", getattr(owner, "reports", ()))
    return len(getattr(owner, "rounds_started", ())), len(landed)
